"""The published-GPU-measurement benchmark: its data file's schema, and one end-to-end run.

The data file is the benchmark: every row must say where its number comes from, what the number
is, how to rebuild the step and how far to trust it, or the comparison means nothing. The
end-to-end run rebuilds the smallest row (a 163M-parameter GPT at 8 x 1024 tokens, traced on
fake tensors) in a subprocess, as a user would run the script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "external_cuda.py"
DATA = REPO / "benchmarks" / "data" / "external_cuda.json"

sys.path.insert(0, str(REPO))
from benchmarks.external_cuda import BUILDERS, LOSSES, load_rows, published_bytes, published_stack  # noqa: E402

MEASURED = {"allocated_peak", "reserved_peak", "reserved_after", "nvidia_smi_total"}
PRECISIONS = {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}


@pytest.fixture(scope="module")
def data():
    return json.loads(DATA.read_text())


def test_at_least_20_rows_from_5_sources(data):
    # the least a comparison with published measurements needs to say something beyond one lab
    assert len(data["rows"]) >= 20
    assert len({r["source"] for r in data["rows"]}) >= 5
    # sources by the same author or organisation are not independent: count authors, not source keys
    authors = {data["sources"][r["source"]]["independent_author"] for r in data["rows"]}
    assert len(authors) >= 5, sorted(authors)
    assert len({r["id"] for r in data["rows"]}) == len(data["rows"]), "row ids must be unique"


def test_every_source_is_cited(data):
    for key, src in data["sources"].items():
        for field in ("title", "url", "gpu_as_published", "measured_as_published", "torch"):
            assert src.get(field), f"source {key} lacks {field}"
        assert src["url"].startswith("https://"), key


def test_every_row_has_citation_setup_value_and_confidence(data):
    from memguard.estimator.gpus import GPUS

    for row in data["rows"]:
        rid = row["id"]
        assert row["source"] in data["sources"], rid
        assert row.get("where"), f"{rid}: no place in the source"
        assert row["gpu"] in GPUS, f"{rid}: GPU {row['gpu']!r} is not a catalog name"
        assert row["measured"] in MEASURED, rid
        assert published_bytes(row["published"]) > 0, rid
        assert row["confidence"] in {"high", "medium", "low"}, rid
        assert len(row.get("confidence_note", "")) > 20, f"{rid}: confidence note too thin"
        if row["measured"] == "nvidia_smi_total":
            assert "context_published" in row or "nvidia-smi" in row["confidence_note"], rid


def test_resolved_setups_are_complete():
    _, rows = load_rows(DATA)
    for row in rows:
        setup, rid = row["setup"], row["id"]
        assert setup["model"]["builder"] in BUILDERS, rid
        assert setup["precision"] in PRECISIONS, rid
        assert setup["batch"]["batch_size"] >= 1, rid
        assert setup.get("loss", "model_loss") in LOSSES, rid
        assert setup["optimizer"]["name"], rid
        assert isinstance(setup.get("activation_checkpointing", False), bool), rid


STRATEGIES = {"fsdp2"}


def test_set_covers_conv_nets_and_multi_gpu_ranks():
    # issue 22: the set must not be transformers on one GPU only
    _, rows = load_rows(DATA)
    assert any(r["setup"]["model"]["builder"] == "convnet" for r in rows)
    assert any(int(r["setup"].get("world_size", 1)) > 1 for r in rows)


def test_sharded_rows_name_their_world():
    # a per-rank peak of a multi-GPU job means nothing without the strategy, ranks and sharding level
    _, rows = load_rows(DATA)
    sharded = [r for r in rows if r["setup"].get("strategy")]
    assert sharded, "no multi-GPU row"
    for row in sharded:
        setup, rid = row["setup"], row["id"]
        assert setup["strategy"] in STRATEGIES, rid
        assert int(setup["world_size"]) > 1, rid
        assert int(setup["zero_stage"]) in (1, 2, 3), rid
    # rows of one source that differ only in world size resolve to the same model
    by_id = {r["id"]: r for r in rows}
    a, b = by_id["torchtitan-llama3.1-8b-fsdp8-b2-s8192"], by_id["torchtitan-llama3.1-8b-fsdp128-b2-s8192"]
    assert a["setup"]["model"] == b["setup"]["model"] and (a["setup"]["world_size"], b["setup"]["world_size"]) == (8, 128)


@pytest.mark.parametrize("arch, params", [
    # torchvision's parameter counts of these models (torchvision.models, 1000 classes)
    ("resnet50", 25_557_032), ("vgg16", 138_357_544), ("mobilenet_v2_sequential", 3_504_872),
    ("googlenet", 13_004_888),
])
def test_conv_nets_have_torchvisions_parameter_counts(arch, params):
    model = BUILDERS["convnet"]({"arch": arch})
    assert sum(p.numel() for p in model.parameters()) == params


def test_conv_net_forward_shapes():
    import torch

    x = torch.empty(2, 3, 224, 224, device="meta")
    assert BUILDERS["convnet"]({"arch": "resnet50"})(x).shape == (2, 1000)
    out = BUILDERS["convnet"]({"arch": "googlenet"}).train()(x)  # training: (logits, aux2, aux1)
    assert [o.shape for o in out] == [(2, 1000)] * 3
    unet = BUILDERS["convnet"]({"arch": "unet", "height": 416, "width": 608})
    assert unet(torch.empty(1, 3, 416, 608, device="meta")).shape == (1, 1, 416, 608)


def test_torchtitan_llama3_8b_shapes():
    _, rows = load_rows(DATA)
    (row,) = [r for r in rows if r["id"] == "torchtitan-llama3.1-8b-fsdp8-b2-s8192"]
    model = BUILDERS["torchtitan_llama"](row["setup"]["model"])
    # torchtitan logs 8,030,261,248 parameters for Llama 3 8B (FFN hidden 14336, 8 KV heads)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.layers[0].block.w1.out_features == 14336


def test_torchtitan_selective_checkpointing_matches_plain_backward():
    # the selective-op checkpoint wrapper must not change the step's result, only what is saved
    import torch

    from benchmarks.external_cuda import _torchtitan_loss

    cfg = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.3, multiple_of=32, norm_eps=1e-5,
               rope_theta=500000.0, vocab_size=97, max_seq_len=16)
    grads = []
    for ac in ("none", "selective_op"):
        torch.manual_seed(0)
        model = BUILDERS["torchtitan_llama"]({"config": dict(cfg, ac=ac)}).to_empty(device="cpu")
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
            theta = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
            freqs = torch.outer(torch.arange(16).float(), theta)
            model.freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        ids = torch.arange(32).remainder(97).view(2, 16)
        _torchtitan_loss(model, (ids, ids)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_liger_baselines_hold_what_the_script_holds():
    # the torch provider's step keeps its leaf input (with gradient) and the unused Liger module's weight
    model = BUILDERS["liger_baseline"]({"kernel": "fused_linear_cross_entropy", "BT": 4096, "H": 4096, "V": 128256})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"input", "lin.weight"}
    assert model.unused_liger_lin.weight.shape == (128256, 4096)


def test_units_are_the_sources_units():
    # "GB" as printed by x / 1e9, "GiB"/"MiB" where the source divides by 1024**k
    assert published_bytes({"value": 1.5, "unit": "GB"}) == 1_500_000_000
    assert published_bytes({"value": 2, "unit": "GiB"}) == 2 << 30
    assert published_bytes({"value": 1341, "unit": "MiB"}) == 1341 << 20


def test_same_as_lays_the_row_over_its_base():
    _, rows = load_rows(DATA)
    by_id = {r["id"]: r for r in rows}
    # hf-bert-large-fp16-b4 only changes the precision of hf-bert-large-fp32-b4
    base, row = by_id["hf-bert-large-fp32-b4"]["setup"], by_id["hf-bert-large-fp16-b4"]["setup"]
    assert row["precision"] == "16-mixed" and base["precision"] == "32-true"
    assert row["model"] == base["model"] and row["batch"] == base["batch"]


@pytest.mark.parametrize("torch_field, stack", [
    ("2.1.0.dev20230623+cu118 (watermark in logs.md)", {"torch_version": "2.1.0", "cuda_version": "11.8"}),
    ("2.6.0+cu124 (printed in the README's log)", {"torch_version": "2.6.0", "cuda_version": "12.4"}),
    ("2.4.1", {"torch_version": "2.4.1"}),  # no CUDA tag: the release's default wheel
    ("not stated (2024 LitGPT releases)", {}),
])
def test_published_stack_reads_the_version_a_source_printed(torch_field, stack):
    assert published_stack({"torch": torch_field}) == stack


def test_script_runs_one_row_end_to_end(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the estimate must not need a GPU
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "llmfs-gpt124m-fp32-b8", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "external_cuda.json").read_text())
    (row,) = report["rows"]
    assert row["id"] == "llmfs-gpt124m-fp32-b8"
    # the source printed memory_reserved(), so the comparison must use the reserved peak
    assert row["measured"] == "reserved_after"
    assert row["predicted_bytes"] == row["estimate"]["peak_bytes"]
    assert row["published_bytes"] == round(26.2617 * (1 << 30))
    assert row["error"] == pytest.approx((row["predicted_bytes"] - row["published_bytes"]) / row["published_bytes"])
    # 163M parameters with AdamW in fp32 hold 16 bytes per parameter before any activation
    assert row["estimate"]["num_params"] == 163_009_536
    assert row["predicted_bytes"] > 16 * 163_009_536
    assert report["summary"]["rows"] == 1
    md = (tmp_path / "external_cuda.md").read_text()
    assert "llmfs-gpt124m-fp32-b8" in md and "Command:" in md
