"""train-eagle3's training side: target features against transformers, the training-time-test
bookkeeping, and a tiny end-to-end run (loss falls, acceptance rises, the head reloads
strictly, training resumes from its checkpoint). Its data side: test_train_data.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve.cli import main
from specserve.core.model_config import load_hf_config
from specserve.model.eagle3 import load_eagle3_head
from specserve.model.loader import load_model, resolve_model
from specserve.train.distill import Sample
from specserve.train.features import record_features
from specserve.train.prompts import PromptItem
from specserve.train.trainer import train
from specserve.train.ttt import UnrollOutput, acceptance_stats, ttt_mask
from tests.support.train_cases import AUX, make_target, train_config, write_prompt_file


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("target4"))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, prompt_file):
    out = tmp_path_factory.mktemp("run")
    return out, train(train_config(out, target, prompt_file))


def test_loss_falls_and_acceptance_rises(trained):
    _, result = trained
    first, last = result.losses[:5], result.losses[-5:]
    assert sum(last) / 5 < 0.9 * sum(first) / 5
    before = result.metrics["initial"]["train_subset"]
    after = result.metrics["train_subset"]
    assert after["step_acc"][0] > before["step_acc"][0] + 0.03
    assert after["mean_accept_len"][-1] > before["mean_accept_len"][-1]


def test_outputs_and_strict_reload(trained, target):
    out, result = trained
    for name in (
        "data.jsonl",
        "heldout_prompts.jsonl",
        "log.jsonl",
        "metrics.json",
        "state.pt",
        "config.json",
        "model.safetensors",
    ):
        assert (out / name).is_file(), name
    raw = json.loads((out / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    head = load_eagle3_head(out, load_hf_config(target), torch.bfloat16, "cpu")
    assert head.aux_layer_ids == tuple(AUX)
    trained_w = result.head.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, trained_w[name].to(tensor.dtype)), name
    curve = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "loss" in r] == [10, 20, 30, 40, 50, 60]


def test_resume_continues_from_checkpoint(trained, target, prompt_file, tmp_path, capsys):
    out, _ = trained
    shutil.copytree(out, tmp_path / "run", dirs_exist_ok=True)
    args = [
        "train-eagle3",
        "--target",
        str(target),
        "--data",
        str(prompt_file),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "70",
        "--batch-size",
        "8",
        "--ttt-steps",
        "3",
        "--draft-vocab-size",
        "128",
        "--heldout-prompts",
        "4",
        "--max-new-tokens",
        "32",
        "--aux-layer-ids",
        "1",
        "2",
        "3",
        "--no-progress",
    ]
    assert main(args) == 2  # a checkpoint is there and --resume was not given
    assert "--resume" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    assert "mean acceptance length" in capsys.readouterr().out
    records = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "start"] == [0, 60]
    assert not [r for r in records if r.get("event") == "generated"][1:]  # data reused
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=False)["step"] == 70
    # A time budget ends training early, whatever --steps says.
    steps_at = args.index("--steps") + 1
    long_run = args[:steps_at] + ["100000"] + args[steps_at + 1 :]
    assert main(long_run + ["--resume", "--train-time-s", "1"]) == 0
    state_path = tmp_path / "run" / "state.pt"
    state = torch.load(state_path, weights_only=False)
    assert 70 < state["step"] < 100000
    # A time budget cut short (its schedule 60% through) goes on from there when resumed,
    # not from the peak learning rate (which re-heated a half-annealed head)
    state["progress"] = 0.6
    torch.save(state, state_path)
    log_path = tmp_path / "run" / "log.jsonl"
    seen = len(log_path.read_text().splitlines())
    assert main(long_run + ["--resume", "--train-time-s", "1"]) == 0
    records = [json.loads(ln) for ln in log_path.read_text().splitlines()]
    peak = next(r["config"]["lr"] for r in records if r.get("event") == "start")
    lrs = [r["lr"] for r in records[seen:] if "lr" in r]
    assert lrs and max(lrs) < 0.5 * peak  # (the schedule at 60%: 0.41 of the peak, then lower)


def test_init_head_continues_training(trained, target, prompt_file, tmp_path):
    out, result = trained
    shutil.copy(out / "data.jsonl", tmp_path / "data.jsonl")
    cfg = train_config(
        tmp_path, target, prompt_file, init_head=str(out), steps=5, resume=True, draft_vocab_size=64
    )  # the head's own vocabulary wins
    more = train(cfg)
    assert more.head.config.draft_vocab_size == 128
    assert torch.equal(more.head.d2t, result.head.d2t)
    start = more.metrics["initial"]["train_subset"]["step_acc"][0]
    assert start == pytest.approx(result.metrics["train_subset"]["step_acc"][0], abs=0.02)


def test_init_head_keeps_the_prompts_it_held_out_out_of_training(
    trained, target, prompt_file, tmp_path
):
    """A head trained further from --init-head trains on none of the prompts that head held
    out (a variant of one neither) and lists them in its own heldout_prompts.jsonl, once,
    so its checkpoint resumed, with the flag or without it, keeps them out too: each seed
    holds out texts of its own, and the head of session 56 trained on most of its init
    head's held-out stdlib prompts."""
    out, _ = trained
    head, run = tmp_path / "head", tmp_path / "run"
    shutil.copytree(out, head)
    run.mkdir()
    for name in ("data.jsonl", "heldout_prompts.jsonl"):
        shutil.copy(out / name, run / name)
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    sources = [PromptItem(r["key"], []).source_key for r in rows if r["split"] == "train"]
    picked = sorted(set(sources))[:2]
    extra = [  # the head held out two texts this data trains on, one named by a variant
        {"key": picked[0], "messages": [{"role": "user", "content": "a"}]},
        {"key": picked[1] + "#v1", "messages": [{"role": "user", "content": "b"}]},
    ]
    head_lines = (head / "heldout_prompts.jsonl").read_text().splitlines()
    (head / "heldout_prompts.jsonl").write_text(
        "\n".join(head_lines + [json.dumps(e) for e in extra]) + "\n"
    )
    own_lines = (run / "heldout_prompts.jsonl").read_text().splitlines()
    dropped = sum(s in picked for s in sources)
    assert dropped >= 2
    runs = [  # the first from the head, then its checkpoint resumed with and without it
        dict(init_head=str(head), steps=2),
        dict(init_head=str(head), steps=4),
        dict(steps=6),
    ]
    for i, kw in enumerate(runs):
        result = train(train_config(run, target, prompt_file, resume=True, **kw))
        assert result.metrics["train_samples"] == len(sources) - dropped
        assert (run / "heldout_prompts.jsonl").read_text().splitlines() == own_lines + [
            json.dumps(e) for e in extra
        ]  # the run's own first, then the head's it did not hold out itself
        events = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines()]
        starts = [e["step"] for e in events if e.get("event") == "start"]
        assert starts == [0, 2, 4][: i + 1]  # (resumed from state.pt after the first)
        last = [e for e in events if e.get("event") == "heldout_kept_out"][-1]
        assert last["init_head"] == kw.get("init_head")
        assert last["held_out_prompts"] == len(own_lines) + 2
        assert last["dropped_samples"] == dropped
        assert last["listed_now"] == (2 if i == 0 else 0)


def test_features_are_inputs_of_the_aux_layers(target):
    transformers = pytest.importorskip("transformers")
    model = load_model(resolve_model(str(target)), torch.float32, torch.device("cpu"))
    samples = [
        Sample("a", [5, 9, 11, 40, 7, 3, 90], 2),
        Sample("b", list(range(20, 45)), 4),
        Sample("c", [8, 8, 8], 1),
    ]
    store = record_features(
        model, samples, tuple(AUX), tokens_per_batch=16, page_size=4, progress=False
    )  # several batches, sequences across pages
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    for i, s in enumerate(samples):
        rows = slice(store.offsets[i], store.offsets[i + 1])
        with torch.no_grad():
            o = ref(torch.tensor([s.token_ids]), output_hidden_states=True)
        want = torch.cat([o.hidden_states[j][0] for j in AUX], dim=-1)  # [j] enters layer j
        torch.testing.assert_close(store.aux[rows], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(store.hidden[rows], o.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
        assert torch.equal(store.argmax[rows], o.logits[0].argmax(-1))


def test_live_features_batch_as_a_store_does(target):
    """`LiveFeatures` (--features live) runs the target over a batch's samples when the
    batch is asked for, each cut to the batch's max_len first: the same batch as a store
    recorded once gives, up to the order of the batched sums."""
    from specserve.train.features import LiveFeatures

    model = load_model(resolve_model(str(target)), torch.float32, torch.device("cpu"))
    samples = [
        Sample("a", [5, 9, 11, 40, 7, 3, 90], 2),
        Sample("b", list(range(20, 45)), 4),
        Sample("c", [8, 8, 8], 1),
    ]
    store = record_features(model, samples, tuple(AUX), tokens_per_batch=16, progress=False)
    live = LiveFeatures(model, samples, tuple(AUX))
    assert len(live) == 3 and live.offsets == store.offsets and live.length(1) == 25
    for indices, max_len in (([2, 0], None), ([1, 2], 12), ([1], None)):
        want, got = store.batch(indices, max_len), live.batch(indices, max_len)
        for name in ("aux", "hidden"):
            torch.testing.assert_close(
                getattr(got, name), getattr(want, name), atol=1e-4, rtol=1e-4
            )
        for name in ("argmax", "tokens", "lengths", "prompt_lens"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.host_lengths == want.host_lengths
    assert len(live.subset(2)) == 2 and live.subset(2).offsets == store.subset(2).offsets


def test_live_features_train_as_stored_ones(trained, target, prompt_file, tmp_path):
    """--features live from the same data: the same losses step by step as stored ones,
    nothing kept (the features event logs it)."""
    out, _ = trained
    losses = {}
    for mode in ("stored", "live"):
        run = tmp_path / mode
        run.mkdir()
        shutil.copy(out / "data.jsonl", run / "data.jsonl")
        cfg = train_config(run, target, prompt_file, steps=6, resume=True, features=mode)
        losses[mode] = train(cfg).losses
        events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        (features,) = [e for e in events if e.get("event") == "features"]
        assert features["live"] == (mode == "live")
        assert features["gib"] == 0.0 or mode == "stored"
    assert len(losses["live"]) == 6
    assert losses["live"] == pytest.approx(losses["stored"], rel=1e-4)


def test_unrolled_steps_stay_in_the_rotary_table(target):
    """A sample ending near the target's context: its padding (widths are multiples of 16)
    and its last anchors at step k ran past the head's rotary table (IndexError on CPU, a
    device assert on CUDA). Their positions stop at the sample's last token; the scored
    positions are those of a head with a longer table."""
    from dataclasses import replace

    from specserve.model.eagle3 import Eagle3Config, Eagle3Head
    from specserve.model.loader import load_config
    from specserve.train.features import FeatureStore, make_batch
    from specserve.train.ttt import unroll

    gen = torch.Generator().manual_seed(0)
    target_cfg = replace(load_config(resolve_model(str(target))), max_position_embeddings=40)
    lengths, h, vocab = [38, 9], target_cfg.hidden_size, target_cfg.vocab_size
    n = sum(lengths)
    store = FeatureStore(
        aux=torch.randn(n, 3 * h, generator=gen),
        hidden=torch.randn(n, h, generator=gen),
        argmax=torch.randint(0, vocab, (n,), generator=gen),
        tokens=torch.randint(0, vocab, (n,), generator=gen),
        offsets=[0, lengths[0], n],
        prompt_lens=[4, 2],
    )
    batch = make_batch(store, [0, 1])
    assert batch.tokens.shape[1] == 48  # padded past the 40 positions
    embed = torch.randn(vocab, h, generator=gen)
    outs = []
    for positions in (40, 80):
        cfg = Eagle3Config.for_target(
            replace(target_cfg, max_position_embeddings=positions), vocab, tuple(AUX)
        )
        torch.manual_seed(0)
        head = Eagle3Head(cfg, tuple(AUX))
        head.d2t.zero_()
        head.t2d.fill_(True)
        head.rotary.materialize(torch.device("cpu"))
        outs.append(unroll(head, embed, embed, batch, steps=4))
    short, long = outs
    assert torch.equal(short.step_losses, long.step_losses)
    for a, b in zip(short.correct, long.correct):
        assert torch.equal(a, b)


def test_ttt_mask_and_acceptance_stats():
    mask = ttt_mask(3, 2, torch.device("cpu"))
    assert mask.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    t = torch.tensor
    valid = [t([[True, True, True, False]]), t([[True, True, False, False]])]
    correct = [t([[True, False, True, False]]), t([[True, True, False, False]])]
    stats = acceptance_stats([UnrollOutput(torch.zeros(()), [0.0, 0.0], valid, correct)])
    assert stats["step_acc"] == [pytest.approx(2 / 3), 1.0]
    assert stats["chain"] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert stats["mean_accept_len"] == [pytest.approx(5 / 3), 2.0]


def test_max_train_tokens_caps_the_feature_store(trained, target, prompt_file, tmp_path):
    """The store is one allocation of every training token's features: more data than the
    device holds failed after the generation; the first samples within the cap are kept."""
    out, result = trained
    shutil.copy(out / "data.jsonl", tmp_path / "data.jsonl")
    cfg = train_config(tmp_path, target, prompt_file, steps=2, resume=True, max_train_tokens=300)
    capped = train(cfg)
    assert 0 < capped.metrics["train_tokens"] <= 300
    assert capped.metrics["train_samples"] < result.metrics["train_samples"]
    log = [json.loads(ln) for ln in (tmp_path / "log.jsonl").read_text().splitlines()]
    (event,) = [r for r in log if r.get("event") == "train_tokens_capped"]
    assert event["cap"] == 300 and event["tokens"] == capped.metrics["train_tokens"]
