"""Command-line tools on top of the other layers: start tritonserver, add a model to the repository, build the
default model."""
