# Serving image for a package made by `optimize` for an NVIDIA GPU target.
# Build from inside the package directory:  docker build -t my-pruned-model .
# Run:  docker run --gpus all -p 8000:8000 my-pruned-model
# The official vLLM image; pin the version the package's manifest was tested with.
ARG VLLM_VERSION={{VLLM_VERSION}}
FROM vllm/vllm-openai:${VLLM_VERSION}
COPY . /package
{{ENV}}EXPOSE 8000
ENTRYPOINT {{ENTRYPOINT}}
CMD ["--host", "0.0.0.0", "--port", "8000"]
