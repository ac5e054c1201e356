# Serving image for an ONNX package made by `optimize --format onnx`.
# Build from inside the package directory:  docker build -t my-pruned-model .
# Run:  docker run -p 8000:8000 my-pruned-model
# The server (ort_server.py, copied into the package) needs only onnxruntime, numpy and tokenizers.
# For a GPU, start from a CUDA runtime image and install onnxruntime-gpu instead.
FROM python:3.12-slim
RUN pip install --no-cache-dir "onnxruntime=={{ORT_VERSION}}" numpy tokenizers
COPY . /package
EXPOSE 8000
ENTRYPOINT {{ENTRYPOINT}}
CMD ["--host", "0.0.0.0", "--port", "8000"]
