"""What an ONNX package runs at serving time: `ort_server.py`, which the package carries a copy
of and which needs only numpy, onnxruntime, tokenizers and its web stack (FastAPI, uvicorn,
jinja2), never this project (so it reads manifest.json as plain JSON, not through core.manifest,
which the package does not carry)."""
