"""What a package needs at serving time, shared by the side that writes packages (exporters/)
and the side that serves them (serve/), so neither imports the other: the manifest's name and
schema, the engine's server command, and the onnxruntime server an ONNX package carries a copy
of (`ort_server.py`, standalone: numpy, onnxruntime and tokenizers only)."""
