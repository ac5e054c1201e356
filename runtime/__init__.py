"""What an ONNX package runs at serving time: `ort_server.py`, which the package carries a copy
of and which needs only numpy, onnxruntime and tokenizers (so it reads manifest.json as plain
JSON, not through core.manifest, which the package does not carry)."""
