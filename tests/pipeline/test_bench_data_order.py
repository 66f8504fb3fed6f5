"""``make bench-data-order``: the documents per batch it prints, on a small log-normal split."""

from __future__ import annotations

import re

from pipeline.bench.data_order import main


def test_the_block_order_is_within_ten_percent_of_uniform_windows_and_the_window_order_is_not(capsys):
    assert main(["--documents", "400", "--seq-len", "2048", "--batch", "16", "--batches", "12"]) == 0
    out = capsys.readouterr().out
    rows = {
        name.strip(): float(mean) for name, mean in re.findall(r"^([a-z][^\n\d]*?) +([\d.]+) +\d+ +\d+%$", out, re.M)
    }
    assert set(rows) == {"uniform windows", "blocks (default)", "window (before)"}, out
    assert rows["blocks (default)"] >= 0.9 * rows["uniform windows"], out
    assert rows["window (before)"] < 0.9 * rows["uniform windows"], out


def test_a_lengths_folder_that_is_not_one_is_one_line(tmp_path, capsys):
    assert main(["--lengths-from", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"bench-data-order: error: --lengths-from {tmp_path / 'missing'} is not a folder"
    )


def test_bench_reader_times_both_orders_over_the_same_sequences(tiny_data, capsys):
    from pipeline.bench import reader

    assert reader.main(["--data", str(tiny_data), "--epochs", "1", "--repeats", "1", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(window|blocks) +([\d,]+) ", out, re.M))
    assert set(rows) == {"window", "blocks"} and all(int(v.replace(",", "")) > 0 for v in rows.values()), out
    assert re.search(r"^blocks / window: throughput [\d.]+x, peak memory [\d.]+x$", out, re.M), out
