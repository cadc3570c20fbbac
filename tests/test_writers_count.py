"""``data.writers``: the built-in writers dataset's writer count."""

import numpy as np
import pytest

from feddg.config import build_config
from feddg.data.writers import writer_styles
from feddg.federation.setup import load_data, make_clients, make_split


def test_data_writers_sets_how_many_writers_and_so_natural_clients(tmp_path):
    cfg = build_config({"data": {"dataset": "writers", "writers": 7, "cache_dir": str(tmp_path), "seed": 3},
                        "split": {"protocol": "federated"}, "partition": {"kind": "natural", "holdout": 0.0}})
    ds = load_data(cfg)
    assert ds.domains == ds.group_names == [f"w000{i}" for i in range(7)]
    per_writer = writer_styles(3, 7)["digits"]  # 5 to 15 digits each, drawn per seed
    np.testing.assert_array_equal(np.bincount(ds.groups), per_writer)
    assert 5 <= per_writer.min() < per_writer.max() <= 15  # the documented range, not one count for all
    assert len(ds) == per_writer.sum()
    clients = make_clients(ds, make_split(ds, cfg), cfg)
    assert [len(c.train_idx) for c in clients] == list(per_writer)


def test_a_writer_count_for_another_dataset_is_one_line(tmp_path):
    cfg = build_config({"data": {"dataset": "digits-dg", "writers": 7, "cache_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match="digits-dg takes no writer count"):
        load_data(cfg)
