"""pytorch/examples' word_language_model through ironloop, its ``data.py`` and ``model.py``
used unmodified (``wlm_dir``: a checkout of pytorch/examples/word_language_model).

The one thing to know is the layout. word_language_model's ``batchify`` + ``get_batch`` serve
**time-first** batches, ``(bptt, streams)``, because its ``RNNModel`` runs ``nn.LSTM`` without
``batch_first``. ironloop's ``ContiguousStreams`` serves the same chunks **batch-first**,
``(streams, bptt)``: sample ``k`` is one stream's chunk. So the step transposes the batch
(``x.t()``) and flattens the targets time-first (``y.t()``), as ``get_batch`` does; the rest is
word_language_model's own loop: ``init_hidden`` at the start, the hidden state carried and
detached (``repackage_hidden``) in ``state``, ``NLLLoss`` on the model's log-probabilities.
``tests/data/test_lm.py`` checks this step against the plain time-first loop (``torch.equal``).

    ironloop train configs/word_language_model.yaml data.kwargs.wlm_dir=WLM_DIR
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from torch import nn
from torch.nn import functional as F


def _import(wlm_dir: str, name: str):
    """word_language_model's own module ``name`` (data, model), from its checkout."""
    if not (Path(wlm_dir) / f"{name}.py").is_file():
        raise FileNotFoundError(f"{wlm_dir}/{name}.py not found: set wlm_dir to a checkout of "
                                f"pytorch/examples/word_language_model")
    if wlm_dir not in sys.path:
        sys.path.insert(0, wlm_dir)
    return importlib.import_module(name)


def data(root: str, wlm_dir: str, streams: int = 20, bptt: int = 35,
         eval_streams: int = 10) -> dict:
    """The data factory: word_language_model's ``Corpus(root)`` (train.txt, valid.txt,
    test.txt), each split as ContiguousStreams (train.batch_size = streams); validation and test
    in batches of ``eval_streams`` (its eval_batch_size 10), one chunk of every stream each. The
    vocab size and wlm_dir go to the model factory."""
    from torch.utils.data import DataLoader

    from ironloop.data.lm import ContiguousStreams

    corpus = _import(wlm_dir, "data").Corpus(root)
    evaluated = {split: DataLoader(ContiguousStreams(ids, eval_streams, bptt),
                                   batch_size=eval_streams)
                 for split, ids in (("val", corpus.valid), ("test", corpus.test))}
    return {"train": ContiguousStreams(corpus.train, streams, bptt), **evaluated,
            "vocab_size": len(corpus.dictionary), "wlm_dir": wlm_dir}


def model(vocab_size: int, wlm_dir: str, rnn_type: str = "LSTM", emsize: int = 200,
          nhid: int = 200, nlayers: int = 2, dropout: float = 0.2) -> nn.Module:
    """The model factory: word_language_model's ``RNNModel``, unmodified."""
    return _import(wlm_dir, "model").RNNModel(rnn_type, vocab_size, emsize, nhid, nlayers,
                                              dropout)


def step(model: nn.Module, batch, state):
    """word_language_model's step on ironloop's batch-first chunks (see the module doc)."""
    x, y = batch                                  # (streams, bptt), batch-first
    hidden = state.get("hidden")
    if hidden is None:                            # an epoch's (or an evaluation's) start
        hidden = model.init_hidden(x.shape[0])
    output, hidden = model(x.t(), hidden)         # the model reads time-first (bptt, streams)
    state["hidden"] = hidden                      # stored detached: repackage_hidden
    return F.nll_loss(output, y.t().reshape(-1)), {}, y.numel()
