"""A zoo of tiny BERTs as the stages ablations and geometry_lines read one, shared by their tests."""
import functools

from tests.models import bert_batch, tiny_bert


def batches():
    """The zoo's sharpness batches: four batches of four sequences of length 5."""
    return [bert_batch(s, n=4, length=5) for s in range(4)]


class TinySource:
    """A zoo of tiny BERTs as the stage reads one (loaders and the primary's batches)."""

    def __init__(self, n):
        self.names = [f"model_{i:03d}" for i in range(n)]

    def loaders(self, names=None, device="cpu"):
        names = self.names if names is None else list(names)
        return [(k, functools.partial(tiny_bert, self.names.index(k))) for k in names]

    def sharpness_batches(self, n_points, batch_size, seed):
        assert (n_points, batch_size, seed) == (16, 4, 0)
        return batches()
