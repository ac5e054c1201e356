"""Hardware profiles: the YAML files load, the 2:4 facts hold, detection falls back to cpu."""

import pytest

from optimizer import profiles as P
from optimizer.errors import UserError

EXPECTED = {"a100", "h100", "h200", "l4", "l40s", "rtx4090", "rtx5090", "b200", "t4", "v100",
            "cpu"}


def test_all_profiles_load_and_names_match_files():
    loaded = P.list_profiles()
    assert {p.name for p in loaded} == EXPECTED
    assert [p.name for p in loaded] == sorted(EXPECTED)
    stems = {f.stem for f in P.PROFILES_DIR.glob("*.yaml")}
    assert stems == EXPECTED
    for p in loaded:
        assert p.kind in ("gpu", "cpu")
        assert set(p.engines) >= {"vllm", "onnxruntime"}
        assert p.memory_gib > 0 and p.memory_bandwidth_gbps > 0 and p.peak_fp32_tflops > 0
        if p.kind == "gpu":
            assert p.compute_capability and p.nvml_names
        if p.sparse_tensor_cores:
            assert p.peak_bf16_sparse24_tflops == pytest.approx(2 * p.peak_bf16_dense_tflops,
                                                                rel=0.02)
        else:
            assert p.peak_bf16_sparse24_tflops is None


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_has_vllm_24_kernel_only_up_to_0_18(name):
    p = P.load_profile(name)
    assert p.has_sparse24_kernel("vllm", "0.18.0")
    assert p.has_sparse24_kernel("vllm", "0.18.0+cu124")
    assert not p.has_sparse24_kernel("vllm", "0.19.0")
    assert not p.has_sparse24_kernel("vllm", "0.32.0")
    assert not p.has_sparse24_kernel("onnxruntime", "1.22.0")
    assert not p.has_sparse24_kernel("no-such-engine", "0.18.0")
    assert "2:4 kernel available" in p.sparse24_reason("vllm", "0.18.0")
    assert "no 2:4 kernel" in p.sparse24_reason("vllm", "0.19.0")


def test_other_targets_never_have_a_vllm_24_kernel():
    for p in P.list_profiles():
        if p.name in ("h100", "h200"):
            continue
        for version in ("0.8.0", "0.18.0", "0.32.0", "0.32.0+cpu"):
            assert not p.has_sparse24_kernel("vllm", version), (p.name, version)
    reason = P.load_profile("a100").sparse24_reason("vllm", "0.32.0")
    assert reason.startswith("A100 (SM 8.0) + vLLM 0.32.0: no 2:4 kernel (")
    assert "Ampere" in reason


def test_invalid_version_is_no_kernel_not_a_crash():
    p = P.load_profile("h100")
    assert not p.has_sparse24_kernel("vllm", "not-a-version")
    assert "not a valid version" in p.sparse24_reason("vllm", "not-a-version")


def test_turing_and_volta_have_no_sparse_tensor_cores():
    for name in ("t4", "v100"):
        assert not P.load_profile(name).sparse_tensor_cores
    assert not P.load_profile("cpu").sparse_tensor_cores
    assert P.load_profile("a100").sparse_tensor_cores


@pytest.mark.parametrize("alias,expected", [
    ("A100", "a100"), ("rtx-4090", "rtx4090"), ("4090", "rtx4090"), ("h100-sxm", "h100"),
    ("NVIDIA L4", "l4"), ("RTX 5090", "rtx5090"), ("CPU", "cpu"),
])
def test_load_profile_aliases(alias, expected):
    assert P.load_profile(alias).name == expected


def test_unknown_target_lists_known_targets():
    with pytest.raises(UserError) as err:
        P.load_profile("mi300x")
    msg = str(err.value)
    assert "unknown target 'mi300x'" in msg
    assert "known targets: a100, b200, cpu, h100" in msg


@pytest.mark.parametrize("gpu,expected", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA B200", "b200"),
])
def test_match_profile(gpu, expected):
    assert P.match_profile(gpu).name == expected


def test_match_profile_unknown():
    assert P.match_profile("NVIDIA GB200") is None  # not B200: word boundary
    assert P.match_profile("Some Other Accelerator") is None


def test_missing_key_names_file_and_key(tmp_path, monkeypatch):
    text = (P.PROFILES_DIR / "a100.yaml").read_text()
    broken = "\n".join(l for l in text.splitlines() if not l.startswith("memory_bandwidth_gbps"))
    _refused(tmp_path, monkeypatch, broken, r"a100\.yaml.*memory_bandwidth_gbps")


def _refused(tmp_path, monkeypatch, a100_text: str, match: str) -> None:
    """Loading the profiles with a100.yaml replaced by `a100_text` raises a UserError matching `match`."""
    (tmp_path / "a100.yaml").write_text(a100_text)
    monkeypatch.setattr(P, "PROFILES_DIR", tmp_path)
    P._all_profiles.cache_clear()
    try:
        with pytest.raises(UserError, match=match):
            P.list_profiles()
    finally:
        monkeypatch.undo()
        P._all_profiles.cache_clear()


def test_auto_profile_without_driver_is_cpu(monkeypatch):
    def no_driver():
        raise P.NoDriverError("NVML Shared Library Not Found")

    monkeypatch.setattr(P, "detect_gpus", no_driver)
    profile, why = P.auto_profile()
    assert profile.name == "cpu"
    assert "No NVIDIA driver found" in why and "cpu" in why
    text = P.format_detection()
    assert text.startswith("No NVIDIA driver found")
    assert "--target auto will use the 'cpu' profile." in text


def test_auto_profile_on_this_machine():
    # The CI machines have no GPU; on a GPU machine this checks the detected one matches.
    try:
        gpus = P.detect_gpus()
    except UserError as exc:
        assert "no NVIDIA driver found (NVML could not be initialised)" in str(exc)
        gpus = []
    if gpus:
        pytest.skip(f"this machine has a GPU: {gpus[0]['name']}")
    profile, why = P.auto_profile()
    assert profile.name == "cpu" and why


def _fake_gpu(name, cc="9.0", mem=79.6):
    return [{"index": 0, "name": name, "memory_gib": mem, "compute_capability": cc,
             "driver_version": "560.35.03", "cuda_driver_version": "12.6"}]


def test_auto_profile_known_gpu(monkeypatch):
    monkeypatch.setattr(P, "detect_gpus", lambda: _fake_gpu("NVIDIA H100 80GB HBM3"))
    profile, why = P.auto_profile()
    assert profile.name == "h100"
    assert "NVIDIA H100 80GB HBM3" in why and "'h100'" in why
    assert "--target auto will use the 'h100' profile." in P.format_detection()


def test_auto_profile_unknown_gpu(monkeypatch):
    monkeypatch.setattr(P, "detect_gpus", lambda: _fake_gpu("NVIDIA RTX A6000", cc="8.6"))
    with pytest.raises(UserError) as err:
        P.auto_profile()
    assert "NVIDIA RTX A6000" in str(err.value)
    assert "a100" in str(err.value) and "rtx4090" in str(err.value)
    assert "--target auto will fail" in P.format_detection()


def test_profiles_table_lists_every_profile():
    table = P.format_profiles_table(P.list_profiles())
    for p in P.list_profiles():
        assert p.name in table
    h100_row = next(l for l in table.splitlines() if l.startswith("h100 "))
    a100_row = next(l for l in table.splitlines() if l.startswith("a100 "))
    assert "<=0.18.0" in h100_row and h100_row.rstrip().endswith("fp8")
    assert a100_row.rstrip().endswith("int8") and "--quant auto (vLLM" in table.splitlines()[0]


# --quant auto: the precision each target's tensor cores and vLLM's kernels accelerate (issue 26)
QUANT_MATRIX = {"0.32.0": {"a100": "int8", "t4": "int8", "cpu": "int8", "v100": "none", "h100": "fp8", "h200": "fp8",
                           "l4": "fp8", "l40s": "fp8", "rtx4090": "fp8", "b200": "fp8", "rtx5090": "fp8"},
                "0.8.0": {"b200": "none", "rtx5090": "none", "h100": "fp8", "a100": "int8", "cpu": "int8"},
                "0.4.0": {p: "none" for p in ("a100", "h100", "cpu", "l4", "t4")}}


@pytest.mark.parametrize("version", QUANT_MATRIX)
def test_the_quant_choice_matrix(version):
    for name, expected in QUANT_MATRIX[version].items():
        precision, why = P.load_profile(name).choose_quant("vllm", version)
        assert precision == expected, (name, version, why)
        assert f"vLLM {version}" in why and (P.QUANT_NAMES[precision] in why or precision == "none")
    assert set(QUANT_MATRIX["0.32.0"]) == {p.name for p in P.list_profiles()}  # every target in the matrix


def test_no_fp8_w8a8_without_fp8_tensor_cores_and_no_int8_on_blackwell():
    for p in P.list_profiles():
        if p.has_quant_kernel("vllm", "0.32.0", "fp8"):
            assert p.peak_fp8_dense_tflops, p.name
        if p.compute_capability and float(p.compute_capability) >= 10:
            assert not p.has_quant_kernel("vllm", "0.32.0", "int8"), p.name  # vLLM: not on SM >= 10.0
    assert P.load_profile("cpu").has_quant_kernel("vllm", "0.32.0", "w4a16")


def test_an_unknown_quant_precision_in_a_profile_is_an_error(tmp_path, monkeypatch):
    text = (P.PROFILES_DIR / "a100.yaml").read_text().replace("      w4a16:", "      int4:")
    _refused(tmp_path, monkeypatch, text, r"a100\.yaml.*quant_kernels.*int4")


def test_a_bad_block_overhead_in_a_profile_is_an_error(tmp_path, monkeypatch):
    for bad in ("{16: -1}", "{true: 0.3}", "[0.3]", "{16: .inf}"):
        text = (P.PROFILES_DIR / "a100.yaml").read_text() + f"block_step_overhead_ms: {bad}\n"
        _refused(tmp_path, monkeypatch, text, r"a100\.yaml.*block_step_overhead_ms")
