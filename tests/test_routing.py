"""Where each client's task runs (server/routing.py): the cohort's work spread over the
devices that hold the clients' shards, without changing who may answer for a client."""

import contextlib
import threading
import time

import numpy as np
import torch
from test_wire import _dealer, _serve  # tests/ is on sys.path under pytest

from flt.common.wire import Message
from flt.server.federation import Federation
from flt.server.routing import host_blocks, spread
from flt.server.transport import Transport


def loads(dest, cost):
    out = {}
    for c, d in dest.items():
        out[d] = out.get(d, 0) + cost(c)
    return out


def test_movable_tasks_even_out_a_lopsided_cohort_and_the_rest_stay_home():
    home = {c: "a" for c in range(6)} | {6: "b"}
    everyone = ("a", "b")
    dest = spread(home, range(5), dict.fromkeys(home, everyone), everyone, lambda c: 1.0)
    assert dest[5] == "a" and dest[6] == "b"  # not movable: at home
    assert sorted(loads(dest, lambda c: 1.0).values()) == [3, 4]  # was 6 / 1
    assert spread(home, range(5), dict.fromkeys(home, everyone), everyone, lambda c: 1.0) == dest  # deterministic


def test_an_even_cohort_stays_where_it_is_hosted():
    home = {0: "a", 1: "a", 2: "b", 3: "b"}
    both = ("a", "b")
    assert spread(home, home, dict.fromkeys(home, both), both, lambda c: 10.0) == home


def test_largest_clients_are_placed_first_by_their_samples():
    home = dict.fromkeys(range(4), "a")
    size = {0: 600, 1: 300, 2: 200, 3: 100}.__getitem__
    both = ("a", "b")
    dest = spread(home, home, dict.fromkeys(home, both), both, size)
    assert sorted(loads(dest, size).values()) == [600, 600]


def test_hosts_get_even_shares_of_samples_when_ids_come_group_by_group():
    # a structured partition numbers clients group by group, and the first groups hold most
    # of the data (pooled FEMNIST's digits); id blocks gave one of two hosts 5x the other's
    rng = np.random.default_rng(0)
    samples = np.concatenate([rng.integers(200, 800, 20), rng.integers(20, 60, 80)])
    clients = np.arange(100) + 7  # ids need not start at 0 (newcomers)
    for n in (2, 3, 7):
        blocks = host_blocks(clients, samples, n)
        assert np.array_equal(np.sort(np.concatenate(blocks)), clients)  # each client hosted once
        assert all(np.all(np.diff(b) > 0) for b in blocks)
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        load = [samples[b - 7].sum() for b in blocks]
        assert max(load) - min(load) <= samples.max()
        id_blocks = [samples[b - 7].sum() for b in np.array_split(clients, n)]
        assert max(load) < 0.8 * max(id_blocks)
    assert host_blocks(clients, samples, 2)[0].tolist() == host_blocks(clients, samples, 2)[0].tolist()
    assert [len(b) for b in host_blocks(np.arange(2), np.ones(2), 3)] == [1, 1, 0]


def test_a_task_goes_only_where_the_shard_is_and_never_to_a_lost_device():
    home = {0: "a", 1: "a", 2: "a", 3: "gone"}
    holders = {0: ("a",), 1: ("a", "b"), 2: ("a", "b", "gone"), 3: ("gone", "b")}
    dest = spread(home, home, holders, ("a", "b"), lambda c: 1.0)
    assert dest[0] == "a" and dest[3] == "gone"  # its only holder; a lost host keeps its client (lost too)
    assert set(dest.values()) <= {"a", "b", "gone"} and "b" in {dest[1], dest[2]}


@contextlib.contextmanager
def _holders_of_dev_as_clients(device, stop: threading.Event):
    """A server and two device threads answering each task with device(name)(task):
    dev-a hosts clients 0-3 and dev-b also holds their shards."""
    server = Transport()
    threads = [threading.Thread(target=_serve, args=(server.endpoint, n, device(n), stop)) for n in ("dev-a", "dev-b")]
    for t in threads:
        t.start()
    try:
        server.wait_devices(2, timeout_s=10)
        server.client_device.update(dict.fromkeys(range(4), "dev-a"))
        server.holders.update(dict.fromkeys(range(4), ("dev-a", "dev-b")))
        yield server
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.sock.close(linger=0)


def test_a_late_devices_movable_tasks_go_to_other_holders_and_none_is_moved_to_it():
    home = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "a", 6: "a"}
    holders = dict.fromkeys(range(6), ("a", "b", "c")) | {6: ("a",)}
    dest = spread(home, range(5), holders, ("a", "b", "c"), lambda c: 1.0, late=("a",))
    assert [dest[c] for c in (5, 6)] == ["a", "a"]  # not movable, or no other holder: it waits for its host
    assert "a" not in {dest[c] for c in range(5)}  # 4 of b's would even the loads out onto a: not to a late one
    assert sorted(loads({c: dest[c] for c in range(5)}, lambda c: 1.0).values()) == [2, 3]
    assert spread(home, range(5), holders, ("a", "b", "c"), lambda c: 1.0) != dest  # on time, a keeps its own
    # every device late (a timeout shorter than any answer): nothing can move, all stay home
    assert spread(home, range(5), holders, ("a", "b", "c"), lambda c: 1.0, late=("a", "b", "c")) == home


def test_a_device_that_timed_out_gets_no_movable_task_until_it_answers_again():
    """A frozen device (SIGSTOP, a host cut off) is alive but answers nothing: a timed-out
    exchange marks it late and sends its movable tasks once more, unbilled, to another
    holder. Its clients' training was lost in that exchange, then ran there again each
    round, waited out the timeout and was lost, and the balancer even moved other hosts'
    tasks to it."""
    stop, frozen, slow = threading.Event(), threading.Event(), threading.Event()
    got_tasks: dict[str, list[int]] = {"dev-a": [], "dev-b": []}

    def device(name):
        def answer(task):
            while name == "dev-a" and frozen.is_set() and not stop.is_set():
                time.sleep(0.02)  # stopped, as by SIGSTOP: its tasks wait in the socket
            if name == "dev-b" and slow.is_set():
                time.sleep(1.0)  # long enough for the woken dev-a's answers to come first
            got_tasks[name].append(task.client)
            return [Message("metrics", 0, task.client, meta={"batch": task.meta["batch"]})]

        return answer

    with _holders_of_dev_as_clients(device, stop) as server:
        tasks = {c: Message("evaluate", 0, c) for c in range(4)}
        frozen.set()
        first = server.gather(tasks, "metrics", 0.5, movable=range(4))
        assert sorted(first) == [0, 1, 2, 3] and server.late == {"dev-a"} and server.resent == 2
        assert sorted(got_tasks["dev-b"]) == [0, 1, 2, 3]  # dev-a's half went again, to dev-b
        assert server.ledger.totals()["down"]["evaluation"]["messages"] == 4  # the second sends are not billed
        got_tasks["dev-b"].clear()
        slow.set()  # dev-a wakes while this exchange waits for dev-b
        threading.Timer(0.3, frozen.clear).start()
        assert sorted(server.gather(tasks, "metrics", 10, movable=range(4))) == [0, 1, 2, 3]
        assert sorted(got_tasks["dev-b"]) == [0, 1, 2, 3]  # all on dev-b: none waited for dev-a
        # its answers to the first exchange's tasks are stale, not answers for others' clients
        assert server.rejections.summary()["rejected_reasons"].keys() == {"stale"}
        slow.clear()
        server.gather({0: Message("evaluate", 0, 0)}, "metrics", 10)  # its host's own task: it waits it out
        assert not server.late
        got_tasks["dev-a"].clear()
        assert sorted(server.gather(tasks, "metrics", 10, movable=range(4))) == [0, 1, 2, 3]
        assert len(got_tasks["dev-a"]) == 2  # the work is shared again
        frozen.set()  # a real-time deadline cuts its stragglers on purpose: that is no fault
        assert server.gather({0: Message("evaluate", 0, 0)}, "metrics", 0.3, strict=True) == {}
        assert not server.late


def test_a_task_asked_again_of_a_client_that_left_it_unanswered_is_not_billed_and_its_reply_is():
    """FLT's encoder and PACFL's subspace request, sent again to a client whose device was
    late: a broken device must not cost the method traffic, as a moved task's second send
    does not (the quickstart's FLT with a device frozen at set-up paid 1.06 MB more)."""
    stop = threading.Event()

    def device(name):
        return lambda task: [Message("metrics", 0, task.client, meta={"batch": task.meta["batch"]})]

    with _holders_of_dev_as_clients(device, stop) as server:
        tasks = {c: Message("evaluate", 0, c, tensors={"model": np.ones(64, np.float32)}) for c in range(4)}
        assert sorted(server.gather(tasks, "metrics", 10)) == [0, 1, 2, 3]
        first = server.ledger.totals()
        assert sorted(server.gather(tasks, "metrics", 10, again=[1, 3])) == [0, 1, 2, 3]
        second = server.ledger.totals()
        for way, messages in (("down", 2), ("up", 4)):  # tasks of clients 0 and 2; every reply
            got = {k: second[way]["evaluation"][k] - first[way]["evaluation"][k] for k in ("messages", "payload")}
            assert got == {"messages": messages, "payload": messages * first[way]["evaluation"]["payload"] // 4}
        assert server.resent == 2


def test_a_lost_devices_clients_leave_the_present_population_at_once():
    """A device lost mid-exchange: what a strategy asks next in the same round (`flt
    relate`'s retries, a re-clustering at the round's end) goes to the live clients only;
    relate asked the lost ones again, twice, and logged it."""
    server = Transport()
    try:
        server.client_device.update({0: "dev-a", 1: "dev-a", 2: "dev-b", 3: "dev-b"})
        fed = Federation(server, {}, seed=0, timeout_s=10, device=torch.device("cpu"))
        fed.present = np.arange(4)
        assert fed.present.tolist() == [0, 1, 2, 3]
        server.lose("dev-b", "process exited")
        assert fed.present.tolist() == [0, 1]
    finally:
        server.sock.close(linger=0)


def test_an_evaluation_with_a_sent_model_moves_and_one_of_the_hosts_own_model_stays():
    """The federation's evaluation: a task that carries the model reads only the client's
    test shard, so it is spread (and passes by a frozen host); Local's reads the model its
    host keeps, so it stays there."""
    stop = threading.Event()
    got_tasks: dict[str, list[int]] = {"dev-a": [], "dev-b": []}

    def device(name):
        def answer(task):
            got_tasks[name].append(task.client)
            meta = {"batch": task.meta["batch"], "correct": 1.0, "total": 2.0, "loss": 0.5}
            return [Message("metrics", 0, task.client, meta=meta)]

        return answer

    with _holders_of_dev_as_clients(device, stop) as server:
        fed = Federation(server, {}, seed=0, timeout_s=10, device=torch.device("cpu"))
        clients = np.arange(4)
        sent = fed.evaluate(1, clients, torch.zeros(4, 3), np.arange(4))
        assert sorted(sent) == [0, 1, 2, 3] and all(m["correct"] == 1.0 for m in sent.values())
        assert len(got_tasks["dev-a"]) == len(got_tasks["dev-b"]) == 2  # evened out over both holders
        got_tasks["dev-a"].clear(), got_tasks["dev-b"].clear()
        assert sorted(fed.evaluate(2, clients, None, np.arange(4))) == [0, 1, 2, 3]
        assert sorted(got_tasks["dev-a"]) == [0, 1, 2, 3] and not got_tasks["dev-b"]  # the host's own models


def test_a_routed_task_is_answered_only_by_the_device_it_went_to():
    """dev-a hosts every client and forges a reply for each task it did not get; the
    replies that count are dev-b's, and the forgeries are rejected, apart from the traffic."""
    stop = threading.Event()
    got_tasks: dict[str, list[int]] = {"dev-a": [], "dev-b": []}

    def device(name):
        def answer(task):
            got_tasks[name].append(task.client)
            meta = {"batch": task.meta["batch"], "by": name}
            out = [Message("metrics", 0, task.client, meta=meta)]
            if name == "dev-a" and task.meta["last"]:  # the host answers for the ones it lost
                out += [Message("metrics", 0, c, meta={**meta, "by": "forged"}) for c in range(4) if c not in hosted]
            return out

        hosted: list[int] = got_tasks[name]
        return answer

    with _holders_of_dev_as_clients(device, stop) as server:
        server.pinned.add(3)  # its host holds more than the shard: it never moves
        time.sleep(0.2)
        tasks = {c: Message("evaluate", 0, c) for c in range(4)}
        replies = server.gather(tasks, "metrics", 10, movable=range(4))
        time.sleep(0.3)  # the forgeries, if late, are still read and counted
        server.drain()
        assert sorted(replies) == [0, 1, 2, 3]
        assert got_tasks["dev-b"] and 3 not in got_tasks["dev-b"] and len(got_tasks["dev-a"]) == 2
        assert all(replies[c].meta["by"] == ("dev-b" if c in got_tasks["dev-b"] else "dev-a") for c in replies)
        reasons = {r: v["messages"] for r, v in server.rejections.summary()["rejected_reasons"].items()}
        assert sum(reasons.values()) == len(got_tasks["dev-b"]) and set(reasons) <= {"wrong client", "stale"}
        assert server.ledger.totals()["up"]["evaluation"]["messages"] == 4  # forgeries are not traffic
        assert server.moved == len(got_tasks["dev-b"])


def test_drift_pins_a_client_to_its_host():
    server = Transport()
    dev = _dealer(server.endpoint, "dev-a")
    try:
        server.wait_devices(1, timeout_s=10)
        server.client_device.update({4: "dev-a", 5: "dev-a"})
        server.send("dev-a", Message("drift", client=4, tensors={"train": np.arange(3), "test": np.arange(2)}))
        server.send("dev-a", Message("state", client=5, meta={"flag": 0, "watched": 1}))  # nothing kept: free
        assert server.pinned == {4}
    finally:
        dev.close()
        server.sock.close(linger=0)
