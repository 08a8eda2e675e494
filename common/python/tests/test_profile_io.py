"""Host tests of profile_io.py: the ncu CSV parser and the CPU models' closed forms."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import profile_io as pio  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def line(kid, kernel, metric, unit, value):
    return ('"%d","42","05_split_q","127.0.0.1","%s","1","7","(128, 1, 1)","(32, 16, 1)","0",'
            '"9.0","Command line profiler metrics","%s","%s","%s"' % (kid, kernel, metric, unit,
                                                                      value))


def test_parse_ncu_csv_sums_every_kernel():
    text = "\n".join([
        "==PROF== Connected to process 42",
        "05_split_q: B=1 H=16 ...",
        HEADER,
        line(0, "softmax_kernel", "dram__bytes_read.sum", "byte", "1,000,000"),
        line(0, "softmax_kernel", "dram__bytes_write.sum", "byte", "500"),
        line(1, "gemm", "dram__bytes_read.sum", "Mbyte", "2.5"),
        line(1, "gemm", "dram__bytes_write.sum", "Kbyte", "3"),
        line(1, "gemm", "sm__cycles_elapsed.avg", "cycle", "99"),
        "==PROF== Disconnected from process 42",
    ])
    r = pio.parse_ncu_csv(text)
    assert r["kernels"] == 2
    assert r["read"] == 1_000_000 + 2_500_000
    assert r["write"] == 500 + 3000
    assert [k["kernel"] for k in r["per_kernel"]] == ["softmax_kernel", "gemm"]


def test_select_pass_leaves_out_the_harness_and_the_forward():
    text = "\n".join([HEADER] + [
        line(i, name, "dram__bytes_read.sum", "byte", str(10 ** i))
        for i, name in enumerate(["fa::fill_bits_kernel(unsigned short *, unsigned long, "
                                  "unsigned short)", "fill_inputs_kernel(...)",
                                  "flash_forward_kernel", "bwd_preprocess_kernel",
                                  "bwd_dk_dv_kernel"])])
    parsed = pio.parse_ncu_csv(text)
    assert parsed["kernels"] == 5
    fwd = pio.select_pass(parsed, 0)
    assert [k["kernel"] for k in fwd["per_kernel"]] == [
        "flash_forward_kernel", "bwd_preprocess_kernel", "bwd_dk_dv_kernel"]
    bwd = pio.select_pass(parsed, 1)
    assert bwd["kernels"] == 2 and bwd["read"] == 10 ** 3 + 10 ** 4


def test_runner_runs_one_pass():
    args = pio.runner_args({"batch": 1, "heads": 2, "heads_kv": 2, "seqlen": 64,
                            "head_dim": 64, "dtype": "fp16", "causal": False}, "fwd")
    # No warm-up by count nor by time (the runner's --warmup-ms default is 250 ms).
    assert args[args.index("--warmup") + 1] == "0"
    assert args[args.index("--warmup-ms") + 1] == "0"


def test_every_causal_skipping_step_has_the_skip_model():
    for step in ("06_causal_skip", "07_backward", "08_split_kv", "09_hopper_wgmma",
                 "10_hopper_pingpong"):
        assert pio.FORWARD_MODEL[step] == "fa2_skip"


def test_parse_ncu_csv_errors():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        pio.parse_ncu_csv("==PROF== ERR_NVGPUCTRPERM - no permission")
    with pytest.raises(ValueError, match="unknown unit"):
        pio.parse_ncu_csv(HEADER + "\n" + line(0, "k", "dram__bytes_read.sum", "furlong", "1"))
    assert pio.parse_ncu_csv(HEADER)["kernels"] == 0


@pytest.fixture
def elements(monkeypatch):
    """Every element one byte: the closed forms then count elements, as cpu_models.h."""
    monkeypatch.setattr(pio, "HALF", 1)
    monkeypatch.setattr(pio, "FLOAT", 1)


def test_standard_and_fa1_closed_forms(elements):
    B, H, Hkv, N, d = 2, 4, 2, 100, 16
    r, w = pio.standard_forward_bytes(B, H, Hkv, N, N, d, False)
    assert (r, w) == (B * H * (N * d + 2 * N * d + 2 * N * N), B * H * (2 * N * N + N * d + N))
    tc = -(-N // 32)
    r, w = pio.fa1_forward_bytes(B, H, Hkv, N, N, d, True, 64, 32)
    assert r == 2 * B * Hkv * N * d + tc * B * H * N * (2 * d + 2)
    assert w == (tc + 1) * B * H * N * (d + 2)


def test_fa2_forward_hand_count(elements):
    # cpu_models test HandCountedFa2Forward: B=H=1, N=8, d=2, blocks 4x4, no mask.
    assert pio.fa2_forward_bytes(1, 1, 1, 8, 8, 2, False, 4, 4, True) == (8 * 2 + 2 * 2 * 8 * 2,
                                                                          8 * 2 + 8)


def test_fa2_causal_skip(elements):
    dense = pio.fa2_forward_bytes(1, 1, 1, 64, 64, 8, False, 16, 16, True)
    causal = pio.fa2_forward_bytes(1, 1, 1, 64, 64, 8, True, 16, 16, True)
    masked_only = pio.fa2_forward_bytes(1, 1, 1, 64, 64, 8, True, 16, 16, False)
    assert causal[0] < dense[0] and masked_only == dense
    # Q blocks 0..3 see 16, 32, 48, 64 keys: K and V reads 2 * 8 * (16+32+48+64).
    assert causal[0] == 64 * 8 + 2 * 8 * (16 + 32 + 48 + 64)
    # Nq > Nk: the first rows see nothing.
    assert pio.kv_rows_seen(0, 64, 16, 16, 16, True) == 0


def test_fa2_backward_closed_form(elements):
    B, H, Hkv, Nq, Nk, d, br, bc = 1, 2, 1, 40, 56, 8, 16, 16
    r, w = pio.fa2_backward_bytes(B, H, Hkv, Nq, Nk, d, False, br, bc)
    tc = -(-Nk // bc)
    assert r == 2 * B * H * Nq * d + 2 * B * Hkv * Nk * d + tc * B * H * Nq * (4 * d + 2)
    assert w == B * H * Nq * (d + 1) + tc * B * H * Nq * d + 2 * B * Hkv * Nk * d
    rc, wc = pio.fa2_backward_bytes(B, H, Hkv, Nq, Nk, d, True, br, bc)
    assert rc < r and wc < w


def test_bytes_use_the_kernels_element_sizes():
    r, w = pio.fa2_forward_bytes(1, 1, 1, 128, 128, 64, False, 128, 64, False)
    assert r == (128 * 64 + 2 * 128 * 64) * 2        # fp16 Q once, K and V once
    assert w == 128 * 64 * 2 + 128 * 4                # fp16 O, fp32 L


def test_blocks_from_kernel_source(tmp_path, monkeypatch):
    (tmp_path / "05_x").mkdir()
    (tmp_path / "05_x" / "kernel.cu").write_text(
        "#define FA_FWD_BLOCK_N_D128 32\n"
        "template <> struct TileShape<64> {\n"
        "  static constexpr int kBlockM = 128, kBlockN = 64, kNumWarps = 4;\n};\n"
        "template <> struct TileShape<128> {\n"
        "  static constexpr int kBlockM = 128, kBlockN = FA_FWD_BLOCK_N_D128, kNumWarps = 4;\n"
        "};\ntemplate <> struct BwdTileShape<128> {\n"
        "  static constexpr int kBlockM = 64, kBlockN = 128, kWarpsN = 8;\n};\n")
    monkeypatch.setattr(pio, "REPO", str(tmp_path))
    assert pio.parse_blocks("05_x", 128) == (128, 32, "05_x/kernel.cu")
    assert pio.parse_blocks("05_x", 64) == (128, 64, "05_x/kernel.cu")
    assert pio.parse_blocks("05_x", 128, backward=True) == (64, 128, "05_x/kernel.cu")
    assert pio.parse_blocks("99_missing", 128) == (128, 64, "assumed")


def test_model_only_runs_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "io.json"
    assert pio.main(["--model-only", "--steps", "01_naive,06_causal_skip", "--out",
                     str(out), "--causal", "--log-dir", str(tmp_path / "log")]) == 0
    text = capsys.readouterr().out
    assert "| 01_naive | fwd |" in text and "standard" in text
    assert out.exists() and (tmp_path / "io.md").exists()


def test_a_lab_gets_its_steps_model_and_its_own_tiles(tmp_path):
    # A course lab (common/scripts/lab.py start) is a folder in the build's FA_LAB_DIRS with a
    # lab.json naming the step it is for: it is modelled as that step, with the lab's tiles.
    lab = tmp_path / "labs" / "lab_02_mine"
    lab.mkdir(parents=True)
    (lab / "kernel.cu").write_text(
        "template <> struct TileShape<128> {\n"
        "  static constexpr int kBlockM = 32, kBlockN = 128, kNumWarps = 4;\n};\n")
    (lab / "lab.json").write_text('{"name": "lab_02_mine", "target": "02_tiled_fa1"}\n')
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "CMakeCache.txt").write_text("FA_LAB_DIRS:STRING=%s\n" % lab)
    bin_dir = str(tmp_path / "build" / "bin")
    shape = {"batch": 1, "heads": 16, "heads_kv": 16, "seqlen": 4096, "head_dim": 128,
             "causal": False}
    source = pio.step_source("lab_02_mine", bin_dir)
    assert source == (str(lab), "02_tiled_fa1")
    model, r, w, blocks = pio.model_bytes("lab_02_mine", "fwd", shape, source)
    assert model == "fa1"  # 02's model, not FlashAttention-2's
    assert (r, w) == pio.fa1_forward_bytes(1, 16, 16, 4096, 4096, 128, False, 32, 128)
    assert blocks == {"block_r": 32, "block_c": 128, "from": "lab_02_mine/kernel.cu"}
    # Neither a lab nor a step: FlashAttention-2's model and tiles, said to be assumed.
    assert pio.step_source("99_unknown", bin_dir)[1] == "99_unknown"
    assert pio.model_bytes("99_unknown", "fwd", shape)[3]["from"] == "assumed"
