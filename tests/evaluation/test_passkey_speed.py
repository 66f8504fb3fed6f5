"""The passkey eval's speed by position: tokens/s over the window before each 4^k*1024 mark and at the end,
checked against a clock whose cost per token is known."""

from pipeline.evaluation import passkey


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_speed_before_each_mark_and_at_the_end(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(passkey.time, "perf_counter", clock)
    monkeypatch.setattr(passkey, "SPEED_WINDOW", 4096)
    speed = passkey.SpeedByPosition()
    position, segment = 0, 1024
    while position < 70_000:
        # 1000 tokens/s up to 16384, then 250 tokens/s: the growing cost must show at the later marks only
        clock.now += segment / (1000.0 if position < 16384 else 250.0)
        position += segment
        speed.add(position)
    rows = speed.rows()
    assert list(rows) == ["4096", "16384", "65536", str(position)]
    assert rows["4096"] == rows["16384"] == 1000.0
    assert rows["65536"] == rows[str(position)] == 250.0


def test_a_stream_shorter_than_the_window_has_no_rows(monkeypatch):
    monkeypatch.setattr(passkey.time, "perf_counter", FakeClock())
    speed = passkey.SpeedByPosition()
    speed.add(passkey.SPEED_WINDOW - 1)
    assert speed.rows() == {}


def test_rows_average_the_samples_positions():
    records = [{"tokens_per_s_at": {"65536": 10.0, "100": 4.0}}, {"tokens_per_s_at": {"65536": 20.0}}]
    assert passkey._mean_speeds(records) == {"65536": 15.0}
    assert passkey._mean_speeds([{}]) == {}  # a record written before speeds were kept
