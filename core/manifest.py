"""manifest.json, the package contract: what `optimize` writes into every package and what
`serve`, `bench` and the exporters read, as one type.

The sections whose keys are fixed (source, target, plan, engine, tool) are dataclasses; the
open-ended accounts (method, quality, size, checks, heal, quantization, onnx) stay plain dicts:
each kind, stage and exporter writes its own keys there, and the report and the benchmarks read
them by name.

`Manifest.to_json()` writes the file as it always was (the same keys in the same order); a key
this version does not know is kept on reading and written back (`extra`), so a package made by
a newer tool of the same schema passes through unchanged. `SCHEMA` changes only when the JSON
changes shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from core.errors import UserError

MANIFEST = "manifest.json"
SCHEMA = 1
TOOL_NAME = "llm-deploy-optimizer"


def _from(cls, d: dict | None):
    """A fixed section from its dict: keys it does not know are dropped, keys it lacks are None
    (a package written before the key existed)."""
    if d is None:
        return None
    return cls(**{f.name: d.get(f.name) for f in fields(cls)})


def _as_dict(section) -> dict:
    return {f.name: getattr(section, f.name) for f in fields(section)}


@dataclass
class Tool:
    name: str = TOOL_NAME
    version: str | None = None


@dataclass
class Source:
    """The model the package was pruned from."""
    model: str | None = None          # what the user asked for (a path, hub id or "embedded ...")
    hf_dir: str | None = None         # where its HF directory was on the machine that made the package
    architecture: str | None = None
    family: str | None = None


@dataclass
class Target:
    """The hardware profile the package was planned for (profiles/NAME.yaml)."""
    name: str | None = None
    display_name: str | None = None
    kind: str | None = None           # "gpu" or "cpu"
    compute_capability: str | None = None


@dataclass
class Plan:
    """The planner's choice and its roofline prediction (optimizer/plan.py)."""
    text: str = ""
    reasons: list = field(default_factory=list)
    prediction: dict = field(default_factory=dict)
    engine: str | None = None
    engine_version: str | None = None


@dataclass
class Engine:
    """What serves the package and how. The first four fields every format has; the rest are one
    format's (None: absent from the JSON). The field order is the JSON's key order."""
    name: str = "vllm"
    tested_with: str | None = None
    requires: str | None = None
    served_model_name: str = ""
    max_model_len: int | None = None        # onnx
    model_file: str | None = None           # onnx
    dtype: str | None = None                # onnx
    providers: list | None = None           # onnx
    args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    eos_token_ids: list | None = None       # onnx
    external_data: bool | None = None       # onnx
    onnxruntime_genai: dict | None = None   # onnx: {"config": file} or {"unsupported": why}
    sparse24: dict | None = None            # semi-structured: the 2:4 config and its dense fallback
    image_version: str | None = None        # the vLLM image the Dockerfile builds on, where not DEFAULT_VLLM
    plugin: dict | None = None              # per-layer plugin packages
    package_format: str | None = None       # per-layer: "decilm" or "plugin"
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they came

    @classmethod
    def from_dict(cls, d: dict) -> Engine:
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        out = {k: v for k, v in _as_dict(self).items() if v is not None and k != "extra"}
        return {**out, **self.extra}


@dataclass
class Manifest:
    """A package's manifest. Every field has a default so that a reader can stand in for a
    package that is not ours (serve's `bench` of a plain model directory)."""
    engine: Engine = field(default_factory=Engine)
    format: str = "vllm"                    # "vllm" or "onnx": which server `serve` starts
    schema: int = SCHEMA
    created: str | None = None
    tool: Tool = field(default_factory=Tool)
    source: Source | None = None
    target: Target | None = None
    method: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)   # "perplexity", "zeroshot": dense against pruned
    size: dict = field(default_factory=dict)      # parameters and bytes, "ideal_ratio" (and "..._quantized")
    plan: Plan | None = None
    checks: dict = field(default_factory=dict)    # what the job and the exporter verified
    heal: dict | None = None                      # --heal-tokens: the heal stage's account
    quantization: dict | None = None              # --quant: the quantize stage's account
    wall_s: float | None = None
    onnx: dict | None = None                      # ONNX packages: the graph as written
    frontier: dict | None = None                  # a search's candidates, budget and choice (optimizer/search.py)
    extra: dict = field(default_factory=dict)     # top-level keys this version does not know

    # --- typed readings of the open sections ---------------------------------------------------
    @property
    def perplexity(self) -> dict | None:
        """quality.perplexity: {"eval", "windows", "seq_len", "dense", "pruned"[, "pruned_unquantized"]}."""
        return self.quality.get("perplexity")

    @property
    def ideal_ratio(self) -> float | None:
        """The ideal speed-up from weight bytes against the dense model (the quantized bytes where
        the package is quantized); None where the size is unknown."""
        return self.size.get("ideal_ratio_quantized", self.size.get("ideal_ratio"))

    # --- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The manifest as manifest.json holds it, keys in the order they have always been written."""
        d = {"schema": self.schema, "format": self.format, "created": self.created, "tool": _as_dict(self.tool),
             "source": _as_dict(self.source) if self.source else None,
             "target": _as_dict(self.target) if self.target else None,
             "method": self.method, "quality": self.quality, "size": self.size,
             "plan": _as_dict(self.plan) if self.plan else None,
             "engine": self.engine.to_dict(), "checks": self.checks,
             "heal": self.heal, "quantization": self.quantization, "frontier": self.frontier, "wall_s": self.wall_s,
             "onnx": self.onnx}
        # optional sections are absent rather than null, as they always were
        optional = ("created", "source", "target", "plan", "heal", "quantization", "frontier", "wall_s", "onnx")
        return {**{k: v for k, v in d.items() if not (k in optional and v is None)}, **self.extra}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, package_dir: str | Path) -> Path:
        path = Path(package_dir) / MANIFEST
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> Manifest:
        """Parse a manifest; UserError (naming `where`) for another schema or no engine section."""
        if not isinstance(d, dict):
            raise UserError(f"{where}: not a manifest (a JSON object expected)")
        if d.get("schema") != SCHEMA:
            raise UserError(f"{where}: manifest schema {d.get('schema')!r}, this tool reads {SCHEMA}")
        engine = d.get("engine")
        if not isinstance(engine, dict) or "served_model_name" not in engine:
            raise UserError(f"{where}: the manifest has no engine section with a served_model_name")
        known = {f.name for f in fields(cls)} - {"extra"}
        try:
            return cls(schema=d["schema"], format=d.get("format", "vllm"), created=d.get("created"),
                       tool=_from(Tool, d.get("tool")) or Tool(), source=_from(Source, d.get("source")),
                       target=_from(Target, d.get("target")), method=d.get("method") or {},
                       quality=d.get("quality") or {}, size=d.get("size") or {}, plan=_from(Plan, d.get("plan")),
                       engine=Engine.from_dict(engine), checks=d.get("checks") or {}, heal=d.get("heal"),
                       quantization=d.get("quantization"), frontier=d.get("frontier"), wall_s=d.get("wall_s"),
                       onnx=d.get("onnx"),
                       extra={k: v for k, v in d.items() if k not in known})
        except (AttributeError, TypeError) as e:  # a section that is not an object
            raise UserError(f"{where}: garbled manifest ({e})") from None

    @classmethod
    def read(cls, package_dir: str | Path) -> Manifest:
        """The manifest of the package in `package_dir`; UserError where there is none, it is not
        JSON, or it is of another schema."""
        path = Path(package_dir) / MANIFEST
        if not path.is_file():
            raise UserError(f"{package_dir}: not a package made by optimize (no {MANIFEST})")
        try:
            d = json.loads(path.read_text())
        except ValueError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, str(path))


def is_package(directory: str | Path) -> bool:
    """Whether `directory` holds a manifest (read it with Manifest.read)."""
    return (Path(directory) / MANIFEST).is_file()
