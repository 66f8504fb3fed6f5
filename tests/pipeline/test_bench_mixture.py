"""``make bench-mixture`` on a tiny prepared dataset: the parts it cuts are prepared datasets that hold the input's
tokens, every arm reads the same tokens, and the JSON and the table carry every arm."""

from __future__ import annotations

import json
import re

import pytest
from conftest import prepared_copy

from data_prep import format as fmt
from pipeline.bench import mixture
from pipeline.data.reader import MDSReader

SEQ_LEN, BATCH, BATCHES = 64, 4, 12


@pytest.fixture
def data(tmp_path, tiny_data):
    return prepared_copy(tmp_path, tiny_data)


def test_the_parts_are_prepared_datasets_that_partition_the_input(data, tmp_path):
    sizes = mixture.split_three(data, "train", tmp_path / "parts")
    whole = fmt.read_manifest(str(data)).splits["train"]
    assert sum(sizes.values()) == whole.tokens
    assert max(sizes.values()) < 0.5 * whole.tokens, sizes  # about a third each
    docs: set[int] = set()
    for name in mixture.PARTS:
        root = tmp_path / "parts" / name
        manifest = fmt.read_manifest(str(root))  # checks the _COMPLETE marker too
        reader = MDSReader(str(root), "train", cache_dir=None)
        shards = range(reader.num_shards)
        samples = [reader.sample(s, i) for s in shards for i in range(int(reader.samples_per_shard[s]))]
        assert manifest.splits["train"].tokens == sizes[name] == sum(len(t) for t, _ in samples)
        part_docs = {doc for _, doc in samples}
        assert manifest.splits["train"].documents == len(part_docs) and not part_docs & docs, "whole documents"
        docs |= part_docs


def test_every_arm_reads_the_same_tokens_and_the_result_names_them(data, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--data", str(data), "--seq-len", str(SEQ_LEN), "--batch", str(BATCH), "--batches", str(BATCHES)]
    assert mixture.main([*args, "--repeats", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["arms"]) == list(mixture.ARMS)
    assert (result["seq_len"], result["batch"], result["batches"], result["repeats"]) == (SEQ_LEN, BATCH, BATCHES, 2)
    assert set(result["part_tokens"]) == set(mixture.PARTS) and result["processor"]
    sequences = BATCH * BATCHES
    for arm, record in result["arms"].items():
        assert record["tokens"] == sequences * SEQ_LEN, arm
        assert len(record["tokens_per_s_runs"]) == 2 and record["peak_bytes"] > 0
        assert record["tokens_per_s"] > 0 and record["tokens_per_cpu_s"] > 0 and record["cpu_ratio"] > 0
        assert sum(record["sequences_per_source"]) == sequences, arm
    base = result["arms"]["one dataset"]
    assert base["ratio"] == base["cpu_ratio"] == 1.0 and base["sequences_per_source"] == [sequences]
    declared = result["arms"]["mixture 0.5/0.3/0.2"]["sequences_per_source"]
    assert all(abs(n - w * sequences) < 1 for n, w in zip(declared, mixture.DECLARED)), declared
    sizes = [result["part_tokens"][name] for name in mixture.PARTS]
    drawn = result["arms"]["mixture (sizes)"]["sequences_per_source"]
    assert all(abs(n - s / sum(sizes) * sequences) < 1 for n, s in zip(drawn, sizes)), drawn
    text = capsys.readouterr().out
    for arm in mixture.ARMS:
        row = rf"^{re.escape(arm)} +[\d,]+ +[\d.]+x +[\d,]+ +[\d.]+x +[\d.]+ +[\d.]+x$"
        assert re.search(row, text, re.M), text
    assert re.search(r"^mixture / one dataset throughput: [\d.]+x at worst \(target >= 0.95x\): ", text, re.M), text


def test_an_input_that_is_not_a_prepared_dataset_is_one_line(tmp_path, capsys):
    assert mixture.main(["--data", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bench-mixture: error: no prepared dataset with a train split at {tmp_path / 'missing'} (run make prep)"
    )
