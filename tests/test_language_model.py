"""model=gpt on dataset=text (issue 32): the transformer against a plain re-implementation, the tokenizers and
the blocks against hand-worked text, the loss per token against its formula, a small run whose perplexity falls
below a stated bound, and MPI ranks against virtual ranks in float64."""

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bfexp.errors import ConfigError, DatasetError
from bfexp.metrics import cross_entropy, perplexity
from bfexp.models import GPT, build_model, check_fits
from bfexp.text import BytePairTokenizer, CharTokenizer, Text, generated_corpus
from tests.conftest import REPO

GPT_NODE = {"_target_": "bfexp.models.GPT", "n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": None,
            "dropout": 0.0, "bias": True}
# A small form of `bfexp model=gpt dataset=text ranks=4 steps=200` (README: perplexity < 10 there, from 39).
SMALL = ["model=gpt", "dataset=text", "engine=threads", "ranks=2", "steps=60", "log_every=20", "batch_size=16",
         "dataset.block_size=32", "dataset.eval_samples=32", "model.n_embd=32", "model.n_layer=1",
         "optimizer=adam", "lr=0.01", "baseline_steps=0", "scaling.reference_steps=2"]
SMALL_BOUND = 12.0  # the generated corpus's 39 characters: a uniform guess scores 39


# ------------------------------------------------------------------ the model


def reference_gpt(model: GPT, idx: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPT's forward written out: explicit layer norms, a masked softmax per head, tanh-free exact GELU."""
    def norm(x, ln):
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias

    b, t = idx.shape
    x = model.wte.weight[idx] + model.wpe.weight[:t]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for block in model.h:
        h = norm(x, block.ln_1)
        q, k, v = (h @ block.attn.c_attn.weight.T + block.attn.c_attn.bias).chunk(3, dim=-1)
        d = q.shape[-1] // n_head
        heads = []
        for i in range(n_head):
            qi, ki, vi = (z[..., i * d:(i + 1) * d] for z in (q, k, v))
            scores = (qi @ ki.transpose(1, 2)) / math.sqrt(d)
            heads.append(torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ vi)
        x = x + torch.cat(heads, -1) @ block.attn.c_proj.weight.T + block.attn.c_proj.bias
        fc, proj = block.mlp[0], block.mlp[2]
        u = norm(x, block.ln_2) @ fc.weight.T + fc.bias
        x = x + (0.5 * u * (1 + torch.erf(u / math.sqrt(2)))) @ proj.weight.T + proj.bias
    return norm(x, model.ln_f) @ model.wte.weight.T


def test_gpt_matches_a_written_out_transformer_and_is_causal():
    model = build_model(GPT_NODE, (6,), 11, seed=3, dtype=torch.float64)
    idx = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
    out = model(idx)
    assert out.shape == (3, 6, 11)
    assert torch.allclose(out, reference_gpt(model, idx, n_head=2), atol=1e-12, rtol=0)
    later = idx.clone()
    later[:, 4:] = (later[:, 4:] + 1) % 11  # positions 0..3 must not see a change at 4 and 5
    assert torch.equal(model(later)[:, :4], out[:, :4]) and not torch.equal(model(later)[:, 4:], out[:, 4:])


def test_gpt_ties_its_output_to_the_embedding_and_counts_parameters_by_hand():
    model = build_model(GPT_NODE, (6,), 11, seed=0)
    assert model.lm_head.weight is model.wte.weight
    v, t, c, layers = 11, 6, 8, 2
    block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
    assert sum(p.numel() for p in model.parameters()) == v * c + t * c + layers * block + 2 * c
    # nanoGPT's init from the run's seed: N(0, 0.02), residual projections / sqrt(2 n_layer); same seed, same model.
    assert abs(model.wte.weight.std().item() - 0.02) < 0.005
    assert abs(model.h[0].attn.c_proj.weight.std().item() - 0.01) < 0.003
    again = build_model(GPT_NODE, (6,), 11, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_gpt_options_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"model.n_embd=10 is not a multiple of model.n_head=4"):
        GPT((8,), 5, n_head=4, n_embd=10)
    with pytest.raises(ConfigError, match=r"model.block_size=4; allowed: an integer >= 8"):
        GPT((8,), 5, block_size=4)
    assert GPT((8,), 5, block_size=16).wpe.weight.shape == (16, 64)  # a longer context than the data's
    with pytest.raises(ConfigError, match="dataset=text"):
        check_fits({**GPT_NODE, "_target_": "bfexp.models.GPT"}, (1, 28, 28), 10)
    assert check_fits(GPT_NODE, (6,), 11, tokens=True) > 0


def test_loss_per_token_is_the_mean_cross_entropy_over_positions():
    scores = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.tensor([[0, 4, 2], [1, 1, 3]])
    by_hand = -sum(scores[b, t].log_softmax(-1)[y[b, t]] for b in range(2) for t in range(3)) / 6
    assert abs(cross_entropy(scores, y).item() - by_hand.item()) < 1e-6  # the loss is float32
    flat = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2, 3])
    assert torch.equal(cross_entropy(flat, labels), torch.nn.functional.cross_entropy(flat, labels))
    assert perplexity(math.log(39.0)) == pytest.approx(39.0) and perplexity(1e4) == math.inf


# ------------------------------------------------------------------ tokens and blocks


def test_char_tokenizer_is_the_sorted_characters():
    coder = CharTokenizer("héllo wörld")
    assert coder.chars == [" ", "d", "h", "l", "o", "r", "w", "é", "ö"]
    assert coder.encode("hö").tolist() == [2, 8] and coder.decode(coder.encode("wörld")) == "wörld"


def test_bpe_learns_the_most_frequent_pairs_in_order():
    # Pieces: "aaab" once, " aaab" twice, " ab" once. Pair counts: (a,a) 6, (a,b) 4, (" ",a) 3.
    coder = BytePairTokenizer("aaab aaab aaab ab", vocab_size=6)
    assert coder.tokens[:3] == [b" ", b"a", b"b"]
    # aa first; then (a, b) 4 beats (aa, a) 3, (" ", aa) 2, (" ", a) 1; then (aa, ab) 3 beats (" ", aa) 2.
    assert coder.tokens[3:] == [b"aa", b"ab", b"aaab"]
    assert coder.encode("aaab aaab").tolist() == [5, 0, 5]
    assert coder.encode(" aab").tolist() == [0, 3, 2]  # merges in learnt order: aa before ab
    text = "".join(generated_corpus(6)) + "naïve café ✓\n"
    big = BytePairTokenizer(text, vocab_size=300)
    assert big.vocab_size == 300 and big.decode(big.encode(text)) == text
    assert len(big.encode(text)) < len(text.encode("utf-8")) / 2


def test_generated_corpus_is_fixed():
    docs = generated_corpus()
    assert len(docs) == 48 and docs == generated_corpus(48, 24, 0)
    assert docs[0].startswith("On the garden, part 1.\n") and docs[-1].startswith("On the market, part 48.\n")


def test_text_blocks_and_splits_by_hand(tmp_path):
    # Two documents (files) of 21 and 11 characters; 10% held out of each (2 and 1), block_size 4.
    (tmp_path / "a.txt").write_text("abcdefghijklmnopqrstu")
    (tmp_path / "b.txt").write_text("ABCDEFGHIJK")
    data = Text(path=str(tmp_path), block_size=4, test_fraction=0.1, partition="documents", eval_samples=0)
    chars = sorted("abcdefghijklmnopqrstuABCDEFGHIJK")
    assert data.sample_shape() == ((4,), 32)
    # Training stream: a..s (19) then A..J (10) = 29 tokens; held out: "tu" and "K".
    with pytest.raises(DatasetError, match="no held-out block"):  # held out: "tu" + "K", 3 tokens: no block of 5
        data.sizes(2, 0)
    data = Text(path=str(tmp_path), block_size=2, test_fraction=0.1, partition="documents", eval_samples=0)
    rank0, rank1 = data.load(0, 2, 0), data.load(1, 2, 0)
    text = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    assert [text(x) for x in rank0.train_x.tolist()] == ["ab", "cd", "ef", "gh", "ij", "kl", "mn"]
    assert [text(y) for y in rank0.train_y.tolist()] == ["bc", "de", "fg", "hi", "jk", "lm", "no"]
    assert [text(x) for x in rank1.train_x.tolist()] == ["op", "qr", "sA", "BC", "DE", "FG", "HI"]
    assert [text(x) + text(y)[-1] for x, y in zip(rank0.test_x.tolist(), rank0.test_y.tolist())] == ["tuK"]
    assert rank0.tokens and rank0.train_x.dtype == torch.int64 and rank0.classes == 32
    iid = Text(path=str(tmp_path), block_size=2, test_fraction=0.1, eval_samples=0)
    blocks = sorted(text(x) for r in range(2) for x in iid.load(r, 2, 0).train_x.tolist())
    assert blocks == sorted(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "qr", "sA", "BC", "DE", "FG", "HI"])
    assert [text(x) for x in iid.load(0, 2, 0).train_x.tolist()] != [text(x) for x in rank0.train_x.tolist()]


def test_a_file_is_split_into_paragraphs_and_bad_paths_are_refused(tmp_path):
    (tmp_path / "t.txt").write_text("one two\n\n\nthree\n  \nfour five six\n")
    data = Text(path=str(tmp_path / "t.txt"), block_size=2, test_fraction=0.3, eval_samples=0)
    from bfexp.text import read_documents
    assert read_documents(data.path, 0) == ("one two", "three", "four five six\n")
    with pytest.raises(DatasetError, match=r"dataset.path='.*nope' does not exist"):
        Text(path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="holds no files"):
        Text(path=str(tmp_path / "empty"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DatasetError, match="UnicodeDecodeError"):
        Text(path=str(tmp_path / "bin")).sample_shape()
    with pytest.raises(ConfigError, match="dataset.partition='dirichlet'; allowed: iid, documents"):
        Text(partition="dirichlet")


# ------------------------------------------------------------------ training


def test_a_small_run_trains_below_the_perplexity_bound(tmp_path):
    """The small form of the README's out-of-the-box run, through the CLI in this process: held-out
    perplexity from about the vocabulary (39) to below SMALL_BOUND, in summary.json and metrics.jsonl."""
    import os

    from tests.cli_in_process import call

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = call([*SMALL, "hydra.run.dir=run"])
    finally:
        os.chdir(cwd)
    assert got["code"] == 0 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["model"] == "gpt" and summary["dataset"] == "text"
    assert summary["final_perplexity"] == pytest.approx(math.exp(summary["final_eval_loss"]))
    assert summary["final_perplexity"] < SMALL_BOUND < records[0]["perplexity"] < 39 * 1.2
    assert 0 < summary["final_accuracy"] < 1  # next-token accuracy


TINY = ["model=gpt", "dataset=text", "engine=threads", "ranks=2", "steps=4", "log_every=2", "batch_size=4",
        "dataset.block_size=16", "dataset.eval_samples=4", "model.n_embd=16", "model.n_layer=1", "baseline_steps=0",
        "scaling.reference_steps=1"]
# Every option of model=gpt and dataset=text the other tests leave at its default, composed and run small.
OPTIONS = {
    "own-file-bpe-by-document": ["dataset.path={corpus}", "dataset.tokenizer=bpe", "dataset.vocab_size=90",
                                 "dataset.test_fraction=0.2", "dataset.partition=documents"],
    "generated-longer-context": ["dataset.documents=12", "model.block_size=24", "model.dropout=0.1",
                                 "model.bias=false", "model.n_head=2"],
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_every_text_and_gpt_option_composes_and_runs(tmp_path, case):
    import os

    from tests.cli_in_process import call

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(generated_corpus(8)):  # a folder of 8 files: its documents
        (corpus / f"{i:02d}.txt").write_text(doc.replace("the", "thé"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        got = call([*TINY, *(o.format(corpus=corpus) for o in OPTIONS[case]), "hydra.run.dir=run"])
    finally:
        os.chdir(cwd)
    assert got["code"] == 0 and got["escaped"] is None, (got["escaped"] or "") + got["stderr"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and math.isfinite(summary["final_perplexity"])
    config = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    for option in OPTIONS[case]:
        key, value = option.split("=", 1)
        assert str(OmegaConf.select(config, key)).lower() == value.format(corpus=corpus).lower()


ENGINES = ["model=gpt", "dataset=text", "ranks=2", "steps=4", "log_every=2", "dtype=float64", "batch_size=4",
           "dataset.block_size=8", "dataset.eval_samples=4", "model.n_embd=8", "model.n_head=2", "model.n_layer=1",
           "optimizer.momentum=0.9", "algorithm=dsgd", "topology=exp2"]

MPI_CODE = """
import json, sys
from pathlib import Path
from omegaconf import OmegaConf
from bfexp.comm.mpi import MPIEngine
from bfexp.worker import run
config = Path(sys.argv[0]).with_name("config.yaml")
trained = run(OmegaConf.load(config), MPIEngine(), config.parent / "mpi")  # a rank's entry: train
emit({"loss": trained.loss, "parameters": trained.parameters.tolist()})
"""


@pytest.mark.large  # two MPI ranks and two virtual ones, 13 s of CPU: .ci/run
def test_mpi_ranks_and_virtual_ranks_train_the_same_float64_numbers(tmp_path):
    """One spawn of 2 MPI ranks and 2 threads run the worker's real train for 4 steps of DSGD in float64."""
    from bfexp.comm.threads import run_threads
    from bfexp.worker import run
    from tests.mpi_helpers import run_ranks
    from tests.test_threads_equivalence import compose

    cfg = compose(ENGINES)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    for engine in ("mpi", "threads"):
        (tmp_path / engine).mkdir()
    mpi = run_ranks(2, MPI_CODE, tmp_path, timeout=300, env={"OMP_NUM_THREADS": "1"})
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = run_threads(2, lambda e: run(OmegaConf.load(tmp_path / "config.yaml"), e, tmp_path / "threads"))
    finally:
        torch.set_num_threads(saved)
    diffs = []
    for rank in range(2):
        a, b = np.array(mpi[rank]["parameters"]), threads[rank].parameters.numpy()
        assert threads[rank].parameters.dtype == torch.float64
        diffs.append(np.abs(a - b).max())
        assert abs(mpi[rank]["loss"] - threads[rank].loss) <= 1e-12
    assert max(diffs) <= 1e-12, diffs
    print(f"max |mpi - threads| over both ranks' parameters: {max(diffs):.3g}")
    assert abs(mpi[0]["loss"] - mpi[1]["loss"]) > 1e-6  # not trivial: the ranks train on shards of their own
