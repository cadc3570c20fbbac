"""A stand-in augmentation that a test can see: for methods whose uploads must be of the data as stored."""


def shift_training_batches(monkeypatch, dataset, by: float = 100.0) -> None:
    """Every batch ``dataset`` draws with ``train=True`` has ``by`` added to every pixel (``train=False``: as stored)."""
    get_batch = dataset.get_batch

    def shifted(indices, train, generator=None):
        x, y = get_batch(indices, train, generator)
        return (x + by if train else x), y

    monkeypatch.setattr(dataset, "get_batch", shifted)
