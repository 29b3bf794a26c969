"""README "Testing your tasks": the router of router.py tested in process (``TaskRunner``)
and end to end (the pytest plugin's fixtures). Run with ``pytest router_test.py``."""

from broker_adapter.testing import TaskRunner
from router import router

def test_restart_validates_its_payload():
    with TaskRunner(router) as runner:
        assert runner.run("restart", {"server": "web1"}).status == "done"
        assert runner.run("restart", {}).status == "failed"    # no handler call


def test_restart_end_to_end(ba_adapter, ba_client, tmp_path):
    ba_adapter(app="router:router")               # broker-adapter run, stopped after the test
    reply = ba_client.request("restart", {"server": "web1"}, key="t1", timeout_s=60)
    assert reply.result == {"restarted": "web1"}
