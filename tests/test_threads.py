"""`intra_op_threads`: the limit holds inside the block and the caller's count comes back."""

import threading

import pytest
import torch

from aml_ppl._core.threads import intra_op_threads


def test_the_callers_count_comes_back_also_when_the_block_raises(two_threads):
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"):
        with intra_op_threads(1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with intra_op_threads(4):  # never raised above the caller's
        assert torch.get_num_threads() == 2


def test_a_thread_already_running_torch_keeps_its_count(two_threads):
    started, limited, read = threading.Event(), threading.Event(), []

    def worker():
        torch.ones(1 << 20).exp()  # its first parallel op takes the process's count, 2
        started.set()
        limited.wait(timeout=30)
        read.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(timeout=30)
    with intra_op_threads(1):
        limited.set()
        thread.join(timeout=30)
    assert read == [2]
