r"""The chains' random streams (:mod:`aml_ppl._core.streams`): SplitMix64 against its reference
outputs, one chain's NumPy stream against the batch's, and the normals' moments."""

import random

import numpy as np
import torch

from aml_ppl._core.streams import ChainStream, ChainStreams, _uniforms_on_device, mix, word_tensor

# SplitMix64 from state 0 (Steele, Lea & Flood 2014; Vigna's splitmix64.c): its first outputs.
REFERENCE = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)
GAMMA = 0x9E3779B97F4A7C15


def test_the_mixer_gives_splitmix64s_reference_outputs():
    states = [(k * GAMMA) % 2**64 for k in (1, 2, 3)]
    words = mix(torch.stack([word_tensor(state) for state in states]))
    assert [int(word) % 2**64 for word in words] == list(REFERENCE)


def test_one_chains_stream_draws_what_the_batch_draws_for_that_chain():
    r"""Any interleaving of scalar uniforms, uniform vectors and normal vectors: the same
    uniforms, the normals to the rounding of ``log`` and ``cos``, the same state after each, and
    a stream rebuilt from a state continues it."""
    alone, batch, drawing = ChainStream(11), ChainStreams([5, 11]), torch.tensor([False, True])
    order = random.Random(0)
    for _ in range(300):
        kind, count = order.randrange(3), order.randrange(1, 200)
        if kind == 0:
            assert alone.random() == float(batch.uniform(drawing)[1, 0])
        elif kind == 1:
            assert torch.equal(alone.uniform(count), batch.uniform(drawing, count)[1])
        else:
            torch.testing.assert_close(alone.normal(count), batch.normal(drawing, count)[1], rtol=0, atol=1e-14)
        assert alone.state == int(batch.state[1]) % 2**64
    assert int(batch.state[0]) == int(ChainStreams([5]).state[0])  # the chain not drawing stayed
    again = ChainStream.at(int(word_tensor(alone.state)) % 2**64)
    assert [again.random() for _ in range(100)] == [alone.random() for _ in range(100)]


def test_the_words_kept_as_a_tensor_draw_what_numpy_draws():
    r"""Off the CPU the states stay an ``int64`` tensor (:func:`_uniforms_on_device`); run here on
    CPU tensors, that path gives the NumPy path's uniforms and states to the bit, for random
    masks and for every chain (``drawing=None``)."""
    streams, on_device = ChainStreams(range(6)), ChainStreams(range(6)).state
    order = torch.Generator().manual_seed(0)
    for round in range(200):
        count = int(torch.randint(1, 70, (), generator=order))
        drawing = None if round % 5 == 0 else torch.rand(6, generator=order) < 0.5
        uniforms, on_device = _uniforms_on_device(on_device, drawing, count)
        assert torch.equal(uniforms, streams.uniform(drawing, count))
        assert torch.equal(on_device, streams.state)


def test_the_normals_have_the_standard_moments():
    r"""Mean, variance and the lag-one correlation of 40 000 normals in successive vectors of 8,
    each within 5 of its standard errors (1/sqrt(n), sqrt(2/n), 1/sqrt(n))."""
    stream = ChainStream(3)
    draws = torch.stack([stream.normal(8) for _ in range(5000)]).flatten().numpy()
    n = len(draws)
    assert abs(draws.mean()) < 5 / np.sqrt(n)
    assert abs(draws.var() - 1) < 5 * np.sqrt(2 / n)
    assert abs(np.corrcoef(draws[:-1], draws[1:])[0, 1]) < 5 / np.sqrt(n)
