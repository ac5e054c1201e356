# Serving image for an ONNX package made by `optimize --format onnx`.
# Build from inside the package directory:  docker build -t my-pruned-model .
# Run:  docker run -p 8000:8000 -e VLLM_API_KEY=<key> my-pruned-model
# The server (ort_server.py, copied into the package) needs onnxruntime, numpy and tokenizers for the
# model, FastAPI + uvicorn for HTTP and jinja2 for the chat template, pinned to the versions the
# package was tested with. Without VLLM_API_KEY anyone who reaches the port can use it (pass the key
# in the environment: arguments after the image name replace CMD, and with it --host 0.0.0.0).
# `docker stop` sends SIGTERM: the server stops accepting and finishes the requests in flight, for up to
# 30 s (--timeout-graceful-shutdown); Docker waits 10 s by default before SIGKILL: `docker stop -t 35`.
# For a GPU, start from a CUDA runtime image and install onnxruntime-gpu instead.
FROM python:3.12-slim
RUN pip install --no-cache-dir {{REQUIREMENTS}}
COPY . /package
EXPOSE 8000
ENTRYPOINT {{ENTRYPOINT}}
CMD ["--host", "0.0.0.0", "--port", "8000"]
