# Serving image for a package made by `optimize --target cpu`.
# Build from inside the package directory:  docker build -t my-pruned-model .
# Run:  docker run -p 8000:8000 my-pruned-model
# vLLM's official CPU release image.
ARG VLLM_VERSION=v0.32.0
FROM public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:${VLLM_VERSION}
COPY . /package
{{ENV}}EXPOSE 8000
ENTRYPOINT {{ENTRYPOINT}}
CMD ["--host", "0.0.0.0", "--port", "8000"]
