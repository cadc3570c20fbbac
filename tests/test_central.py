"""Central: one client holding every source sample, trained and evaluated like any federated run."""

import numpy as np
import pytest
from toy import toy_federation

from feddg.algorithms import ServerContext
from feddg.algorithms.central import Central
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server

POOLED = ("partition.kind=iid", "partition.num_clients=1")


def test_refuses_a_federation_of_several_clients():
    fed = toy_federation("method.name=central")
    with pytest.raises(ValueError, match="partition.num_clients=1"):
        Central().server_init(fed.model, ServerContext(len(fed.clients), 3, 0))


def test_the_pooled_client_holds_every_source_sample_and_trains_as_fedavg(tmp_path):
    fed = toy_federation("method.name=central", *POOLED)
    (client,) = fed.clients
    np.testing.assert_array_equal(np.sort(np.concatenate([client.train_idx, client.holdout_idx])), fed.split.source_idx)
    assert set(fed.dataset.domain_ids[client.train_idx]) == set(fed.split.source_domains)
    central = Server(fed, tmp_path / "central")
    run_inprocess(central)
    fedavg = Server(toy_federation("method.name=fedavg", *POOLED), tmp_path / "fedavg")
    run_inprocess(fedavg)
    untimed = [[{k: v for k, v in r.items() if not k.startswith("time_")} for r in s.metrics]
               for s in (central, fedavg)]
    assert untimed[0] == untimed[1]
