"""The replica limits and the autoscaler's decisions of `pdserve launch --ray` (pdserve/ray_config.py),
from stats documents shaped as the coordinator's: a short role (phase load over 1, requests queued
on its workers, requests waiting) gets one worker more, one at a time and never past its maximum;
an idle worker goes after the downscale delay, never below the minimum; with every worker gone, a
waiting or refused (cold_start) request brings back each role the launch serves with. No Ray needed:
tests/faults/test_ray_launch.py runs the same decisions on a cluster."""
import pytest

from pdserve.ray_config import Autoscaler, RayConfig, Replica
from pdserve_client.errors import InvalidRequestError


def worker(wid, role="decode", inflight=0, queue=0):
    return {"id": wid, "role": role, "inflight": inflight, "queue": queue, "running": inflight}


def stats(*workers, pending=0, loads=(0.0, 0.0), refused=0):
    return {"workers": list(workers), "pending": pending, "loads": {"prefill": loads[0], "decode": loads[1]},
            "requests": {"error:cold_start": refused} if refused else {}}


def test_replica_limits_per_role_and_for_every_role():
    cfg = RayConfig(min_replicas=("0", "prefill=1"), max_replicas=("decode=3",))
    assert cfg.replica_limits({"prefill": 1, "decode": 1}, ["m"]) == {"m": {"prefill": (1, 1), "decode": (0, 3)}}
    assert RayConfig().replica_limits({"decode": 2}, ["m"]) == {"m": {"decode": (2, 2)}}  # the launch's count, fixed
    for bad in (RayConfig(min_replicas=("gpu=1",)), RayConfig(max_replicas=("decode=x",)), RayConfig(max_replicas=("0",)),
                RayConfig(min_replicas=("3",), max_replicas=("2",))):
        with pytest.raises(InvalidRequestError):
            bad.replica_limits({"decode": 1}, ["m"])


def test_replica_limits_per_model_the_most_specific_wins():
    """MODEL:ROLE=N beside N and ROLE=N: beta may idle to zero decode workers while alpha keeps one."""
    cfg = RayConfig(min_replicas=("1", "beta:decode=0", "beta:prefill=0"), max_replicas=("decode=2", "alpha:decode=4"))
    assert cfg.replica_limits({"prefill": 1, "decode": 1}, ["alpha", "beta"]) == {
        "alpha": {"prefill": (1, 1), "decode": (1, 4)}, "beta": {"prefill": (0, 1), "decode": (0, 2)}}
    assert cfg.named_roles() == {"prefill", "decode"}
    ns = RayConfig(min_replicas=("m:v1:decode=0",))  # a served name with a colon: the last one splits
    assert ns.replica_limits({"decode": 1}, ["m:v1"]) == {"m:v1": {"decode": (0, 1)}}


@pytest.mark.parametrize("values, names", [
    (dict(min_replicas=("gamma:decode=0",)), ["'gamma'", "alpha, beta"]),  # an unknown model, and the ones served
    (dict(max_replicas=("beta:colocated=2",)), ["no colocated worker", "prefill, decode"]),  # a role the launch runs none of
    (dict(min_replicas=("beta:gpu=1",)), ["MODEL:ROLE=N", "'beta:gpu=1'"]),
    (dict(min_replicas=(":decode=1",)), ["MODEL:ROLE=N"]),
    (dict(min_replicas=("beta:=1",)), ["MODEL:ROLE=N"]),
    (dict(min_replicas=("beta:decode=3",), max_replicas=("2",)), ["beta:decode is 2"]),
])
def test_a_bad_per_model_limit_is_refused_naming_it(values, names):
    with pytest.raises(InvalidRequestError) as e:
        RayConfig(**values).replica_limits({"prefill": 1, "decode": 1}, ["alpha", "beta"])
    assert all(n in str(e.value) for n in names), str(e.value)


def test_a_short_role_grows_one_at_a_time_up_to_its_maximum():
    scaler = Autoscaler({"prefill": (1, 1), "decode": (1, 3)}, 10.0, {"prefill", "decode"})
    reps = [Replica("ray1", "prefill", None, 0.0), Replica("ray2", "decode", None, 0.0)]
    busy = stats(worker("ray1-prefill-0", "prefill"), worker("ray2-decode-0", inflight=2, queue=3))
    add, remove = scaler.decide(busy, reps, 1.0)
    assert [role for role, _ in add] == ["decode"] and "queued" in add[0][1] and not remove
    reps.append(Replica("ray3", "decode", None, 1.0))  # not registered yet: no second one meanwhile
    assert scaler.decide(busy, reps, 2.0) == ([], [])
    loaded = stats(*busy["workers"], worker("ray3-decode-0", inflight=2), loads=(0.2, 1.5))
    assert [role for role, _ in scaler.decide(loaded, reps, 3.0)[0]] == ["decode"]
    reps.append(Replica("ray4", "decode", None, 3.0, registered=3.0))
    assert scaler.decide(loaded, reps, 4.0)[0] == []  # at its maximum


def test_idle_workers_go_after_the_delay_down_to_zero_and_a_request_brings_the_roles_back():
    scaler = Autoscaler({"prefill": (0, 1), "decode": (0, 2)}, 5.0, {"prefill", "decode"})
    reps = [Replica("ray1", "prefill", None, 0.0), Replica("ray2", "decode", None, 0.0)]
    idle = stats(worker("ray1-prefill-0", "prefill"), worker("ray2-decode-0"))
    assert scaler.decide(idle, reps, 1.0) == ([], [])  # idle clocks start
    assert scaler.decide(idle, reps, 5.0) == ([], [])
    add, remove = scaler.decide(idle, reps, 6.5)
    assert not add and sorted(r.name for r in remove) == ["ray1", "ray2"]
    assert scaler.decide(stats(), [], 7.0) == ([], [])  # nothing asked: nothing started
    add, _ = scaler.decide(stats(pending=1), [], 8.0)
    assert sorted(role for role, _ in add) == ["decode", "prefill"]
    add, _ = scaler.decide(stats(refused=2), [], 9.0)  # refused while none ran (its TTFT target under the cold start)
    assert sorted(role for role, _ in add) == ["decode", "prefill"] and "cold_start" in add[0][1]
    assert scaler.decide(stats(refused=2), [], 10.0) == ([], [])  # counted once


def test_a_busy_worker_restarts_its_idle_clock():
    scaler = Autoscaler({"decode": (0, 1)}, 5.0, {"decode"})
    reps = [Replica("ray1", "decode", None, 0.0)]
    scaler.decide(stats(worker("ray1-decode-0")), reps, 0.0)
    scaler.decide(stats(worker("ray1-decode-0", inflight=1)), reps, 4.0)
    assert scaler.decide(stats(worker("ray1-decode-0")), reps, 6.0) == ([], [])
    assert scaler.decide(stats(worker("ray1-decode-0")), reps, 11.0)[1] == reps


def test_a_worker_with_requests_in_flight_goes_once_the_others_have_room_for_them():
    """Ray Serve's rule with max_num_seqs as the target: the role's in-flight load held by the other workers' room for
    the delay makes the least busy worker spare (the newest of equals), its requests in flight included (its drain
    lets them complete there); a load over the others' room restarts the clock."""
    scaler = Autoscaler({"decode": (1, 3)}, 5.0, {"decode"})
    reps = [Replica("ray1", "decode", None, 0.0, registered=0.0), Replica("ray2", "decode", None, 0.0, registered=1.0)]

    def two(a, b, seqs=2):
        return stats(*(dict(worker(w, inflight=n), engine={"max_num_seqs": seqs}) for w, n in (("ray1-decode-0", a), ("ray2-decode-0", b))))

    assert scaler.decide(two(1, 2), reps, 0.0) == ([], [])  # 3 in flight, the other's room 2: both needed
    assert scaler.decide(two(1, 1), reps, 1.0) == ([], [])  # 2 fit in one: the clock starts
    assert scaler.decide(two(2, 1), reps, 4.0) == ([], [])  # 3 again: it restarts
    assert scaler.decide(two(1, 1), reps, 5.0) == ([], [])
    assert scaler.decide(two(1, 1), reps, 10.5) == ([], [reps[1]])  # ray2 (newest of equals) with its request in flight
    assert scaler.decide(two(2, 1, seqs=1), reps, 20.0) == ([], [])  # one sequence a worker: 1 + 2 never fit in one


def test_the_kuberay_example_parses_and_its_launch_command_line_parses():
    """docs/operations.md's RayCluster: valid YAML of that kind, and its `pdserve launch` flags are the
    command's (tests/deploy/test_kuberay_manifest.py validates it against KubeRay's CRD schema)."""
    import pathlib
    import re

    yaml = pytest.importorskip("yaml")
    from pdserve.cli import main

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: RayCluster" in b]
    doc = yaml.safe_load(block)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster" and doc["spec"]["workerGroupSpecs"]
    [command] = [c["command"] for c in doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if "command" in c]
    assert command[:2] == ["pdserve", "launch"]
    main.commands["launch"].make_context("pdserve launch", command[2:])  # a flag it does not take raises


def test_a_replica_that_never_registers_is_given_up_and_its_role_grows_again():
    """An actor pending for resources, or a worker that cannot start on its node, never registers:
    past register_timeout_s it is removed, and a short role may ask for another worker again."""
    scaler = Autoscaler({"decode": (1, 3)}, 10.0, {"decode"}, register_timeout_s=60.0)
    reps = [Replica("ray1", "decode", None, 0.0), Replica("ray2", "decode", None, 5.0)]
    busy = stats(worker("ray1-decode-0", inflight=2, queue=3))
    assert scaler.decide(busy, reps, 30.0) == ([], [])  # ray2 still starting: no third one meanwhile
    add, remove = scaler.decide(busy, reps, 70.0)
    assert remove == [reps[1]] and [role for role, _ in add] == ["decode"]


def test_the_roles_the_limits_name():
    assert RayConfig(min_replicas=("0", "prefill=1"), max_replicas=("decode=3",)).named_roles() == {"prefill", "decode"}
    assert RayConfig(max_replicas=("2",)).named_roles() == set()


def test_pdserve_launch_refuses_a_limit_for_a_model_it_does_not_serve(tmp_path):
    """Through the command line: a usage error naming the model, before anything starts (no cluster joined)."""
    pytest.importorskip("ray")
    from click.testing import CliRunner

    from pdserve.cli import main

    for name in ("alpha", "beta"):
        (tmp_path / name).mkdir()
    args = ["launch", "--model", str(tmp_path / "alpha"), "--model", f"{tmp_path / 'beta'}=b2", "--ray", "auto"]
    r = CliRunner().invoke(main, [*args, "--min-replicas", "beta:decode=0"])
    assert r.exit_code == 2 and "no model is served as 'beta'" in r.output and "alpha, b2" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--max-replicas", "b2:decode=0"])
    assert r.exit_code == 2 and "--max-replicas of b2:decode is 0" in r.output, r.output


def test_a_removed_worker_drains_and_is_stopped_once_nothing_is_in_flight_on_it():
    """decide's removal starts a drain (ray_launch's `remove`); a draining replica counts no more for its role, and
    `drained` says stop only once the coordinator shows the drain with nothing in flight (or past drain_timeout_s)."""
    scaler = Autoscaler({"decode": (0, 2)}, 5.0, {"decode"}, drain_timeout_s=60.0)
    reps = [Replica("ray1", "decode", None, 0.0, registered=0.0, draining_since=10.0),
            Replica("ray2", "decode", None, 0.0, registered=0.0)]
    drain = {"for_s": 1.0, "inflight_at_start": 1, "placed_since": 0}
    busy = stats(dict(worker("ray1-decode-0", inflight=1), draining=drain), dict(worker("ray2-decode-0"), draining=None))
    add, remove = scaler.decide(busy, reps, 11.0)
    assert not add and not remove  # ray1 is leaving already: not removed twice; ray2's (the role's) spare clock starts
    assert scaler.drained(busy, reps[0], 11.0) is None  # a request in flight on it: it completes there first
    not_yet = stats(dict(worker("ray1-decode-0"), draining=None))  # the coordinator has not seen the DrainWorker (restarted)
    assert scaler.drained(not_yet, reps[0], 12.0) is None
    done = stats(dict(worker("ray1-decode-0"), draining=drain))
    assert "drained in 3.0 s: the 1 requests in flight at its start completed, 0 placed on it since" == scaler.drained(done, reps[0], 13.0)
    assert "not registered" in scaler.drained(stats(), reps[0], 13.0)
    assert "placed again" in scaler.drained(busy, reps[0], 71.0)
