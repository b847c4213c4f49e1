"""@profiled: the numbered calls of a marked method, on rank 0 only, leave an operator table."""

import torch

from rlkit.observability.profiling import profiled


class Worker:
    def __init__(self, rank):
        self.rank = rank

    @profiled
    def multiply(self, x):
        return x @ x


def test_the_numbered_calls_of_rank_zero_leave_their_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("RLKIT_PROFILE_CALLS", "2,3")
    first, second = Worker(0), Worker(1)
    x = torch.randn(64, 64)
    for _ in range(3):
        assert torch.equal(first.multiply(x), x @ x)
        second.multiply(x)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["Worker.multiply.2.txt", "Worker.multiply.3.txt"]
    table = (tmp_path / "Worker.multiply.3.txt").read_text()
    assert table.startswith("Worker.multiply.3: ") and "s wall" in table
    assert "aten::mm" in table and "by self_cpu_time_total" in table


def test_without_a_folder_nothing_is_profiled(tmp_path, monkeypatch):
    monkeypatch.delenv("RLKIT_PROFILE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    worker = Worker(0)
    for _ in range(4):
        worker.multiply(torch.ones(2, 2))
    assert list(tmp_path.iterdir()) == []
