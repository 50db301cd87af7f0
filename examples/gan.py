"""A GAN on the 8x8 digits, with two optimizers: the DCGAN tutorial's alternating updates.

The model holds both networks (``generator``, ``discriminator``); the step takes a third
parameter, ``optimizers``, and updates each one itself, the discriminator first, then the
generator against the discriminator as it is after its update. ironloop checkpoints both
optimizers by name, clips and guards each on its own parameters, and resumes exact.

From Python::

    from examples import gan
    ironloop.fit(gan.model(), (images, labels), config, step_fn=gan.step,
                 optimizer={"generator": gan.adam, "discriminator": gan.adam})

From the CLI (run from the repository root, so that ``examples`` is importable)::

    ironloop train configs/gan.yaml

``tests/engine/test_several.py`` trains it both ways, kills it mid-run and resumes it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LATENT = 16


class GAN(nn.Module):
    """The two networks the step trains in turn; the model's forward is the generator's."""

    def __init__(self, pixels: int = 64, hidden: int = 64):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(LATENT, hidden), nn.ReLU(),
                                       nn.Linear(hidden, pixels), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(pixels, hidden), nn.LeakyReLU(0.2),
                                           nn.Linear(hidden, 1))

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise)


def model(input_shape=(1, 8, 8), hidden: int = 64) -> GAN:
    """``model.name: examples.gan:model``: sized by the data's input shape."""
    return GAN(int(torch.tensor(input_shape).prod()), hidden)


def adam(params) -> torch.optim.Optimizer:
    """The DCGAN tutorial's Adam, for either network."""
    return torch.optim.Adam(params, lr=2e-4, betas=(0.5, 0.999))


# --8<-- [start:step]
def optimizers(model: GAN) -> dict[str, torch.optim.Optimizer]:
    """``optim.name: examples.gan:optimizers``: one optimizer per network, by name."""
    return {"discriminator": adam(model.discriminator.parameters()),
            "generator": adam(model.generator.parameters())}


def step(model: GAN, batch, optimizers):
    """One step of each network: the discriminator on real and fake images, then the generator
    against the updated discriminator. ``optimizers.update(name, loss)`` is that optimizer's
    backward, clip and step on its own parameters (nothing in evaluation)."""
    real = batch[0].flatten(1) / 8 - 1  # digits' pixels 0..16 -> [-1, 1], as tanh's range
    fake = model.generator(torch.randn(len(real), LATENT, device=real.device))
    ones, zeros = torch.ones(len(real), 1, device=real.device), \
        torch.zeros(len(real), 1, device=real.device)
    d_loss = F.binary_cross_entropy_with_logits(model.discriminator(real), ones) + \
        F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros)
    optimizers.update("discriminator", d_loss)
    g_loss = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    optimizers.update("generator", g_loss)
    return g_loss.detach(), {"d_loss": d_loss.detach()}
# --8<-- [end:step]
