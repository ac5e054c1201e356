"""Write an ONNX package: a decoder graph with KV cache, validated on onnxruntime, plus a server.

The pipeline calls `engine_section` and `write_package` (the same seam as exporters/vllm.py);
`export_decoder` is the reusable step (fp32 or fp16, external data on demand).

Package layout:
  model.onnx (+ model.onnx.data)  the decoder (exporters/decoder.py traced with torch.onnx,
                                  TorchScript exporter, opset 17, standard ops only)
  config.json, generation_config.json, tokenizer files
                                  the HF description (bench reads vocab_size from config.json)
  genai_config.json               for onnxruntime-genai, when the layout is uniform (exporters/genai.py)
  manifest.json, report.md        as for vLLM; the manifest's checks["onnx"] holds the validation,
                                  its onnx section the graph; report.md's "Serving (ONNX)"
                                  section is this module's (`report_section`)
  ort_server.py, launch.sh        a copy of runtime/ort_server.py, which needs only numpy,
                                  onnxruntime, tokenizers and its web stack (SERVER_REQUIRES),
                                  and its launcher
  Dockerfile                      the same on a slim Python image (docker/ort-cpu.Dockerfile)

Written into the caller's temporary directory and renamed into place only after validation
passed, so a graph that does not reproduce the model never becomes a package.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from core.manifest import Engine, Manifest
from exporters import genai
from exporters.decoder import Decoder, LayerShape
from exporters.vllm import DOCKER_DIR, internal_check

MODEL_FILE = "model.onnx"
OPSET = 17
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# protobuf cannot serialize a message over 2 GiB; stay clear of it (initializers + graph).
EXTERNAL_DATA_BYTES = 1_800_000_000
SERVER_FILE = Path(__file__).resolve().parents[1] / "runtime" / "ort_server.py"
# What ort_server.py imports besides the standard library: the package's Dockerfile installs them
# (pinned to this environment's versions, as onnxruntime), launch.sh and report.md name them.
SERVER_REQUIRES = ("onnxruntime", "numpy", "tokenizers", "fastapi", "uvicorn", "jinja2")
# uvicorn's faster event loop and HTTP parser, used when installed (as here, where the server is
# measured): the Dockerfile installs them too, so the image serves as the measured server did.
SERVER_SPEEDUPS = ("uvloop", "httptools")


def engine_section(target_kind: str, max_model_len: int, served_model_name: str) -> dict:
    """The manifest's `engine` entry: what `serve` runs and what the package needs."""
    import onnxruntime
    providers = ["CPUExecutionProvider"] if target_kind == "cpu" else ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return {"name": "onnxruntime", "tested_with": f"onnxruntime {onnxruntime.__version__} (CPU)",
            "requires": "onnxruntime >= 1.17, numpy, tokenizers, fastapi, uvicorn, jinja2 "
                        "(ort_server.py in the package)",
            "served_model_name": served_model_name, "max_model_len": max_model_len,
            "model_file": MODEL_FILE, "dtype": "float32", "providers": providers,
            "args": [], "env": {}}


def export_decoder(model, path: Path, dtype: str = "float32", external_data: bool | None = None,
                   opset: int = OPSET) -> dict:
    """Trace `model` (a transformers LLaMA-style CausalLM) into `path` with KV-cache inputs/outputs.

    dtype: "float32" or "float16" (weights, activations, cache and logits; norms and softmax
    stay fp32 inside the graph). onnxruntime's CPU provider runs an fp16 graph only by
    inserting casts to fp32 around the ops it has no fp16 kernel for: correct, but neither
    smaller in memory nor faster there; fp16 is for GPU providers.
    external_data: weights in `<path>.data` beside the graph; None = only when the graph
    would pass protobuf's 2 GiB limit, True forces it (tests), False refuses large models.
    """
    import onnx
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    t0 = time.time()
    path = Path(path)
    dec = Decoder(model, DTYPES[dtype]).eval()
    weight_bytes = sum(b.numel() * b.element_size() for b in dec.buffers())
    if external_data is None:
        external_data = weight_bytes > EXTERNAL_DATA_BYTES
    elif not external_data and weight_bytes > EXTERNAL_DATA_BYTES:
        raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights cannot be stored inside one ONNX file")
    args = _example_inputs(dec)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer and deprecation warnings: validation is the real check
        raw = str(Path(scratch) / MODEL_FILE)
        with torch.no_grad():
            torch.onnx.export(dec, args, raw, dynamo=False, input_names=dec.input_names(),
                              output_names=dec.output_names(), dynamic_axes=_dynamic_axes(dec),
                              opset_version=opset, do_constant_folding=True)
        proto = onnx.load(raw)  # also reads the weights torch wrote as external files (> 2 GiB)
    meta = {"producer": "llm-deploy-optimizer", "layers": json.dumps([s.__dict__ for s in dec.shapes]),
            "head_dim": str(dec.d), "dtype": dtype}
    for k, v in meta.items():
        proto.metadata_props.add(key=k, value=v)
    data_name = path.name + ".data"
    if external_data:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))
    onnx.checker.check_model(str(path))  # by path: works past 2 GiB
    files = [path.name] + ([data_name] if external_data else [])
    return {"file": path.name, "files": files, "dtype": dtype, "opset": opset, "external_data": external_data,
            "bytes": sum((path.parent / f).stat().st_size for f in files), "weight_bytes": weight_bytes,
            "tied_embeddings": dec.tied, "layers": [s.__dict__ for s in dec.shapes], "head_dim": dec.d,
            "uniform": len({(s.num_heads, s.num_kv_heads, s.intermediate_size) for s in dec.shapes}) == 1,
            "export_s": round(time.time() - t0, 2)}


def quantize_graph(src: Path, dst: Path, external_data: bool, roles: tuple[str, ...], weight_max: int = 127,
                   activation_scales: dict | None = None) -> dict:
    """onnxruntime's own INT8 quantization of the blocks' projections named in `roles` (the decoder's
    MatMul nodes `/layers.{i}/{role}/MatMul`; not attention's activation products), and of the LM head
    where `roles` holds HEAD_ROLE (an untied head: its MatMul HEAD_MATMUL):
    int8 weights symmetric per output channel on [-weight_max, weight_max] (127, or 64: onnxruntime's
    reduce_range, optimizer/quantize.ort_weight_max), and the activations either
      - dynamic (activation_scales None): DynamicQuantizeLinear'd (uint8, per tensor) at run time,
        MatMulInteger (quantize_dynamic); or
      - static, QDQ (activation_scales {(i, role): scale}): QuantizeLinear / DequantizeLinear with
        those scales and zero point 0 in front of each MatMul, its weight an int8 initializer behind
        a DequantizeLinear (quantize_static, QDQ form; the scales given as its tensor overrides, so
        the graph holds exactly the twin's, and as its calibration cache, so nothing is re-measured).
    Returns the graph entries that change."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    proto = onnx.load(str(src), load_external_data=False)
    weights = {i.name for i in proto.graph.initializer if len(i.dims) == 2}
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in weights
               and is_int8_matmul(n.name, roles)]
    nodes = [n.name for n in matmuls]
    if HEAD_ROLE in roles and HEAD_MATMUL not in nodes:
        from exporters.onnx_check import ValidationError
        raise ValidationError("the LM head is to be INT8 but the graph has no MatMul of its own for it "
                              "(a head tied to the embedding: untie it first)")
    if activation_scales is not None and len(nodes) != len(activation_scales):
        from exporters.onnx_check import ValidationError
        raise ValidationError(f"the graph has {len(nodes)} MatMuls to quantize, the PyTorch twin "
                              f"{len(activation_scales)} INT8 Linears")
    overrides = _activation_overrides(matmuls, activation_scales) if activation_scales is not None else None
    del proto
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its advice to run onnxruntime's pre-processing: validation is the check here
    try:
        if overrides is None:
            quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], nodes_to_quantize=nodes,
                             per_channel=True, weight_type=QuantType.QInt8, use_external_data_format=external_data,
                             reduce_range=weight_max == 64)
        else:
            with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".calibration-") as scratch:
                cache = Path(scratch) / "ranges.json"
                _write_calibration_cache(cache, overrides)
                quantize_static(str(src), str(dst), calibration_data_reader=None, quant_format=QuantFormat.QDQ,
                                op_types_to_quantize=["MatMul"], nodes_to_quantize=nodes, per_channel=True,
                                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                                reduce_range=weight_max == 64, use_external_data_format=external_data,
                                calibration_cache_path=cache,
                                # the MatMul's output stays float: only its inputs are quantized
                                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                               "OpTypesToExcludeOutputQuantization": ["MatMul"],
                                               # a pair per MatMul, not one shared by q/k/v (gate/up): onnxruntime
                                               # fuses a pair read by one MatMul only into its integer kernel
                                               # (and see _unshare_pair_constants)
                                               "DedicatedQDQPair": True,
                                               "TensorQuantOverrides": {
                                                   t: [{"scale": np.array(sc, np.float32), "zero_point": np.array(0, np.int8)}]
                                                   for t, sc in overrides.items()}})
    finally:
        root.setLevel(level)
    # the graph and, past 2 GiB, the external data file onnxruntime names after it
    files = [dst.name] + sorted(f.name for f in dst.parent.iterdir() if f.name.startswith(dst.name + "."))
    if activation_scales is not None:
        _unshare_pair_constants(dst)
    onnx.checker.check_model(str(dst))
    if activation_scales is not None:
        _check_qdq_scales(dst, nodes, activation_scales)
    return {"files": files, "bytes": sum((dst.parent / f).stat().st_size for f in files),
            "int8_matmuls": len(nodes), "int8_weight_max": weight_max,
            "int8_activations": "dynamic" if overrides is None else "qdq"}


# The untied LM head (exporters/decoder.Decoder.head): its MatMul, and its key among the INT8 Linears
HEAD_ROLE = "head"
HEAD_MATMUL = "/head/MatMul"
HEAD_KEY = (-1, HEAD_ROLE)


def is_int8_matmul(matmul_name: str, roles: tuple[str, ...]) -> bool:
    """Whether `roles` asks for this MatMul: a block's `/layers.{i}/{role}/MatMul`, or the head's."""
    if matmul_name == HEAD_MATMUL:
        return HEAD_ROLE in roles
    return matmul_name.startswith("/layers.") and matmul_name.count("/") == 3 and matmul_name.split("/")[2] in roles \
        and matmul_name.endswith("/MatMul")


def int8_key(matmul_name: str) -> tuple[int, str]:
    """(block, role) of the decoder's MatMul `/layers.{i}/{role}/MatMul`, HEAD_KEY of the head's: the
    key of its twin's Linear in optimizer/quantize.OrtInt8."""
    if matmul_name == HEAD_MATMUL:
        return HEAD_KEY
    layer, role = matmul_name.split("/")[1:3]
    return int(layer.removeprefix("layers.")), role


def qdq_pairs(graph) -> dict[tuple[int, str], tuple]:
    """The (QuantizeLinear, DequantizeLinear) nodes each block MatMul (and the head's) of a QDQ graph
    reads its activation through, by int8_key."""
    producer = {o: n for n in graph.node for o in n.output}
    pairs = {}
    for mm in graph.node:
        if mm.op_type != "MatMul" or not (mm.name.startswith("/layers.") or mm.name == HEAD_MATMUL):
            continue
        dq = producer.get(mm.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            pairs[int8_key(mm.name)] = (q, dq)
    return pairs


def _activation_overrides(matmuls, scales: dict) -> dict[str, float]:
    """The static scale of each quantized MatMul's input tensor, by tensor name. q, k and v read one
    tensor (as gate and up do), so they share one QuantizeLinear: their scales must agree."""
    by_tensor: dict[str, float] = {}
    for n in matmuls:
        scale = scales[int8_key(n.name)]
        if by_tensor.setdefault(n.input[0], scale) != scale:
            from exporters.onnx_check import ValidationError
            raise ValidationError(f"{n.name} reads {n.input[0]} with scale {scale}, another MatMul with "
                             f"{by_tensor[n.input[0]]}: one tensor gets one QuantizeLinear")
    return by_tensor


def _unshare_pair_constants(path: Path) -> None:
    """Give each QuantizeLinear / DequantizeLinear pair its own scale and zero point initializers.
    The dedicated pairs of q, k and v (gate and up) read the same two: onnxruntime's common
    subexpression elimination then merges the pairs back into one, read by three MatMuls, which its
    QDQ fusion leaves as DequantizeLinear + float MatMul; with their own constants every INT8 MatMul
    becomes MatMulIntegerToFloat (tests/test_onnx.py checks it)."""
    import copy
    import onnx
    proto = onnx.load(str(path), load_external_data=False)  # large weights keep their external references
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    by_scale: dict[str, list] = {}
    for n in graph.node:
        if n.op_type == "QuantizeLinear" and n.input[1] in inits:
            by_scale.setdefault(n.input[1], []).append(n)
    for quantizers in by_scale.values():
        for j, q in enumerate(quantizers[1:], 1):
            pair = [q] + [dq for dq in readers.get(q.output[0], []) if dq.op_type == "DequantizeLinear"]
            for k in (1, 2):
                name = f"{q.input[k]}_pair{j}"
                if name not in inits:
                    inits[name] = copy.deepcopy(inits[q.input[k]])
                    inits[name].name = name
                    graph.initializer.append(inits[name])
                for node in pair:
                    node.input[k] = name
    onnx.save(proto, str(path))


def _check_qdq_scales(path: Path, nodes: list[str], scales: dict) -> None:
    """Each INT8 MatMul of the written graph reads QuantizeLinear -> DequantizeLinear, both with the
    twin's scale, bit for bit, and an int8 zero point 0: the rounding the end-to-end check can only
    bound, checked exactly."""
    import onnx
    from onnx import numpy_helper
    from exporters.onnx_check import ValidationError
    graph = onnx.load(str(path), load_external_data=False).graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer if not i.external_data}
    pairs = qdq_pairs(graph)
    for name in nodes:
        key = int8_key(name)
        if key not in pairs:
            raise ValidationError(f"{name} does not read a QuantizeLinear / DequantizeLinear pair")
        want = np.float32(scales[key])
        for node in pairs[key]:
            got, zp = consts.get(node.input[1]), consts.get(node.input[2])
            if got is None or zp is None or got.tobytes() != want.tobytes() or zp.dtype != np.int8 or int(zp) != 0:
                raise ValidationError(f"{name}: activation scale {got} (zero point {zp}) in the graph's "
                                      f"{node.op_type}, {want} (int8 zero point 0) in the PyTorch twin")


def _write_calibration_cache(path: Path, scales: dict[str, float]) -> None:
    """onnxruntime's calibration cache (its own writer) holding each tensor's symmetric range
    [-127 scale, 127 scale]: quantize_static reads it instead of running a calibration itself."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData, save_tensors_data
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, {
        t: TensorData(lowest=np.float32(-127 * sc), highest=np.float32(127 * sc)) for t, sc in scales.items()}), path)


def _example_inputs(dec: Decoder) -> tuple:
    # Sizes other than 0 and 1 (and all different), so that the tracer cannot mistake one
    # dynamic size for another or for a constant.
    b, s, p = 2, 3, 5
    ids = torch.randint(0, dec.embed.shape[0], (b, s))
    mask = torch.ones(b, p + s, dtype=torch.long)
    pos = torch.arange(p, p + s)[None].expand(b, s).contiguous()
    past = [torch.zeros(b, sh.num_kv_heads, p, dec.d, dtype=dec.dtype) for sh in dec.shapes for _ in range(2)]
    return (ids, mask, pos, *past)


def _dynamic_axes(dec: Decoder) -> dict:
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    axes.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in dec.input_names()[3:]})
    axes.update({n: {0: "batch_size", 2: "total_sequence_length"} for n in dec.output_names()[1:]})
    return axes


def eos_token_ids(model, tokenizer) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return sorted({eos} if isinstance(eos, int) else set(eos))
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if eos is not None else []


def write_package(tmp: Path, out: Path, model, tokenizer, manifest: Manifest, report_md: str,
                  dtype: str = "float32", external_data: bool | None = None, int8=None) -> Path:
    """Export, validate, write the rest; rename `tmp` to `out`. The caller removes `tmp` if this raises.

    int8: given for a model quantized for onnxruntime's INT8 (optimizer/quantize.py: weights on its
    int8 grid, activations fake-quantized by hooks): those hooks (`OrtInt8`: `float_activations()`
    turns them off; `roles`, the block projections that are INT8 by decoder name; `weight_max`, their
    weights' grid [-m, m], 127 or 64 where the CPU has no VNNI; `scales`, a QDQ graph's static
    activation scale by (block, role), else None). The fp32 graph is then exported and validated
    against the model without them, quantized by onnxruntime (`quantize_graph`), and the INT8 graph
    validated against the fake-quantized model with the INT8 tolerance; only the INT8 graph is packaged.
    The manifest gains the graph (`onnx`), its validation (`checks["onnx"]`) and what the server
    needs of it (`engine`); `report_md` (the report up to its plan) this package's Serving section."""
    from exporters.onnx_check import ValidationError, validate
    tmp = Path(tmp)
    model = model.float().eval()
    try:
        if int8 is None:
            graph = export_decoder(model, tmp / MODEL_FILE, dtype=dtype, external_data=external_data)
            checks = validate(model, tmp / MODEL_FILE, dtype=dtype, tokenizer=tokenizer)
        else:
            if dtype != "float32":
                raise ValueError("an INT8 ONNX package is quantized from the float32 graph (--onnx-dtype float32)")
            scratch = tmp / ".float"
            scratch.mkdir()
            with int8.float_activations():
                graph = export_decoder(model, scratch / MODEL_FILE, external_data=external_data)
                float_checks = validate(model, scratch / MODEL_FILE, tokenizer=tokenizer)
            graph.update(quantize_graph(scratch / MODEL_FILE, tmp / MODEL_FILE, graph["external_data"], int8.roles,
                                        int8.weight_max, int8.scales))
            shutil.rmtree(scratch)
            checks = validate(model, tmp / MODEL_FILE, tokenizer=tokenizer, int8=int8,
                              static_activations=int8.scales is not None)
            checks["float_graph"] = float_checks
    except ValidationError as e:
        raise RuntimeError(f"ONNX validation failed, no package written: {e}") from None
    checks["export_s"] = graph["export_s"]

    engine = manifest.engine
    eos = eos_token_ids(model, tokenizer)
    engine.dtype, engine.model_file, engine.eos_token_ids = dtype, MODEL_FILE, eos
    engine.external_data = graph["external_data"]
    shapes = [LayerShape(**s) for s in graph["layers"]]
    reason = genai.unsupported_reason(shapes) or \
        (None if eos else "no EOS token id in the model or tokenizer")
    if reason is None:
        cfg = genai.genai_config(model.config, shapes, graph["head_dim"],
                                 engine.max_model_len or 2048, eos, MODEL_FILE, engine.providers)
        (tmp / genai.FILENAME).write_text(json.dumps(cfg, indent=2) + "\n")
    engine.onnxruntime_genai = {"config": genai.FILENAME} if reason is None else {"unsupported": reason}
    manifest.onnx = {k: graph[k] for k in ("files", "dtype", "opset", "external_data", "bytes", "weight_bytes",
                                           "tied_embeddings", "head_dim", "uniform", "int8_matmuls", "int8_weight_max",
                                           "int8_activations")
                     if k in graph}
    if not graph["uniform"]:
        manifest.onnx["layers"] = graph["layers"]
    manifest.checks["onnx"] = checks

    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    manifest.write(tmp)
    (tmp / "report.md").write_text(f"{report_md}\n\n{report_section(manifest)}")
    shutil.copyfile(SERVER_FILE, tmp / "ort_server.py")
    _write_launcher(tmp, engine)
    _write_dockerfile(tmp, engine)
    for f in tmp.iterdir():
        f.chmod(0o755 if f.name == "launch.sh" else 0o644)
    os.replace(tmp, Path(out).expanduser().resolve())
    return out


def _server_args(engine: Engine) -> list[str]:
    return ["--served-model-name", engine.served_model_name, *engine.args]


def _write_launcher(tmp: Path, engine: Engine) -> None:
    args = shlex.join(_server_args(engine))  # a served name with a space or a quote stays one argument
    text = ("#!/usr/bin/env sh\n"
            "# Serve this package with onnxruntime behind an OpenAI-compatible API (/v1/completions,\n"
            "# /v1/chat/completions). Needs: pip install " + " ".join(SERVER_REQUIRES) + "\n"
            "# Extra arguments go to the server, e.g. ./launch.sh --port 8000 --threads 4\n"
            "# API key (required on every route but /health): VLLM_API_KEY=KEY in the environment (out of\n"
            "# the process list; --api-key KEY also works); clients send Authorization: Bearer KEY.\n"
            "# python3 ort_server.py --help lists the limits (body size, waiting requests, time-outs).\n"
            "set -e\n"
            'HERE="$(cd "$(dirname "$0")" && pwd)"\n'
            f'exec "${{PYTHON:-python3}}" "$HERE/ort_server.py" "$HERE" {args} "$@"\n')
    (tmp / "launch.sh").write_text(text)


def _write_dockerfile(tmp: Path, engine: Engine) -> None:
    entry = ["python3", "/package/ort_server.py", "/package", *_server_args(engine)]
    text = (DOCKER_DIR / "ort-cpu.Dockerfile").read_text().replace("{{ENTRYPOINT}}", json.dumps(entry)) \
        .replace("{{REQUIREMENTS}}", " ".join(f'"{r}"' for r in _pinned(SERVER_REQUIRES + SERVER_SPEEDUPS)))
    (tmp / "Dockerfile").write_text(text)


def _pinned(names) -> list[str]:
    """`name==version` as installed here (the versions the package was written and tested with),
    or the bare name of one that is not installed. By the module's version: onnxruntime-gpu is
    imported as onnxruntime."""
    import importlib
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.import_module(name).__version__}")
        except (ImportError, AttributeError):
            out.append(name)
    return out


def report_section(manifest: Manifest) -> str:
    """The Serving (ONNX) section of the package's report.md: the graph, how to serve it, its validation."""
    e, c, g = manifest.engine, manifest.checks["onnx"], manifest.onnx
    check = internal_check(manifest)
    greedy = c["greedy"]
    tie = f", parted at a near-tie at token {greedy['parted_at_near_tie']['step']}" if greedy["parted_at_near_tie"] else ""
    loosened = (f", or twice the perturbed twins' distance at {c['positions_loosened_by_float_noise']} of "
                f"{c['positions']} positions" if c.get("positions_loosened_by_float_noise") else "")
    exact = c.get("as_written")
    as_written = ([f"- the QDQ graph as written, rounding as onnxruntime did at {exact['near_ties_taken_from_onnxruntime']} "
                   f"near-ties of {exact['activations_compared']:,} quantized values: prefill logits max |diff| "
                   f"{exact['prefill']['logits_max_abs_diff']:.2e}, caches {exact['prefill']['present_max_abs_diff']:.2e} "
                   f"(tolerance {exact['tolerance_of_scale']:g} x the largest logit)"] if exact else [])
    genai_line = (f"- `{genai.FILENAME}`: runs with onnxruntime-genai" if "config" in e.onnxruntime_genai
                  else f"- no `{genai.FILENAME}`: {e.onnxruntime_genai['unsupported']}")
    lines = ["## Serving (ONNX)", "",
             f"- graph: `{g['files'][0]}`{' + external data' if g['external_data'] else ''}, {g['dtype']}, "
             f"opset {g['opset']}, {g['bytes'] / 1e6:.1f} MB, KV cache as past_key_values.*/present.*",
             f"- `./launch.sh` or `serve .` starts `ort_server.py` (onnxruntime with continuous batching "
             f"behind FastAPI/uvicorn: OpenAI-compatible `/v1/completions` and `/v1/chat/completions`; "
             f"`--api-key` or `VLLM_API_KEY`; needs {', '.join(SERVER_REQUIRES)}); `Dockerfile` does the same "
             f"on python:3.12-slim",
             genai_line,
             f"- validated against {c['reference']} on onnxruntime {e.tested_with.split()[1]}: "
             f"prefill logits max |diff| {c['prefill']['logits_max_abs_diff']:.2e}, decode "
             f"{c['decode']['logits_max_abs_diff']:.2e} (tolerance {c['tolerance_of_scale']:g} x the largest logit{loosened}); greedy "
             f"{greedy['matched']}/{greedy['tokens']} tokens identical{tie}",
             *as_written,
             f"- export {c['export_s']:.1f} s, validation {c['validate_s']:.1f} s",
             *([f"- internal check: {check}"] if check else []), ""]
    return "\n".join(lines)
