# The NGC Triton image that matches tritonserver 2.51 (what the tests run against without Docker), with this
# project's Python packages installed for its Python backend. Build context: the repository root.
FROM nvcr.io/nvidia/tritonserver:24.10-py3
WORKDIR /opt/trellm
COPY pyproject.toml ./
COPY backend backend
COPY kernels kernels
COPY client client
RUN pip install --no-cache-dir .
COPY model_repository model_repository
ENV PYTHONUNBUFFERED=1
CMD ["tritonserver", "--model-repository=/opt/trellm/model_repository"]
