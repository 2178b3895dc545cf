"""What the model a data module feeds tells it: the data seam is told the model's inputs, it never guesses them."""

from __future__ import annotations

from abc import ABC, abstractmethod


class DataConsumer(ABC):
    """Mixed into the ``LightningModule`` that an :class:`~xtl.data.XTLDataModule` feeds (``xtl.train.LanguageModule``
    is one): what its model reads besides token ids.

    The data module asks the module of the trainer it runs under, or the one handed to ``XTLDataModule.feed`` when
    it runs on its own.
    """

    @property
    @abstractmethod
    def reads_images(self) -> bool:
        """Whether the model reads images (a vision-language model): chat records keep their image parts as
        placeholder tokens and the packs carry the processed images."""


__all__ = ["DataConsumer"]
