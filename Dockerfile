# The NGC Triton image for GPU hosts, with this project's Python packages installed for its Python backend. Build
# context: the repository root. 26.09 is Triton 2.73 (Ubuntu 24.04, Python 3.12): it carries the 2025 fixes to
# Triton's HTTP front end (2.59.1 / 25.07 and later) that the pip-installed 2.51 the tests run against lacks.
FROM nvcr.io/nvidia/tritonserver:26.09-py3
WORKDIR /opt/trellm
# Ubuntu 24.04 marks its Python as externally managed; this image is the environment.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
COPY pyproject.toml ./
COPY backend backend
COPY kernels kernels
COPY client client
RUN pip install --no-cache-dir .
COPY model_repository model_repository
ENV PYTHONUNBUFFERED=1
CMD ["python3", "-m", "trellm_backend.tools.launch", "--model-repository=/opt/trellm/model_repository", "--verbose"]
