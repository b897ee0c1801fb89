"""Device profiles: distributions, availability windows, trace files, FedScale import."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from flt.emulator.profiles import (
    ProfileError,
    Profiles,
    import_fedscale,
    load_trace,
    profiles_from_distribution,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "scenarios" / "traces" / "example_devices.csv"


def make(windows, period_s=None, m=None):
    m = len(windows) if m is None else m
    return Profiles(
        ms_per_sample=np.full(m, 10.0),
        up_bps=np.full(m, 125_000.0),
        down_bps=np.full(m, 1_000_000.0),
        latency_s=np.full(m, 0.05),
        windows=[np.asarray(w, dtype=float).reshape(-1, 2) for w in windows],
        period_s=period_s,
    )


def brute_online(windows, period, t):
    """Reference: one client, plain Python."""
    if len(windows) == 0:
        return True
    tt = t % period if period is not None else t
    return any(a <= tt < b for a, b in windows)


# --------------------------------------------------------------------------- windows


class TestAvailability:
    def test_offline_at_t_and_half_open_windows(self):
        p = make([[], [[100, 200]], [[0, 50], [300, 400]]])
        c = np.arange(3)
        assert p.online(c, 0.0).tolist() == [True, False, True]
        assert p.online(c, 100.0).tolist() == [True, True, False]
        assert p.online(c, 199.999).tolist() == [True, True, False]
        assert p.online(c, 200.0).tolist() == [True, False, False]  # end is exclusive
        assert p.online(c, 350.0).tolist() == [True, False, True]
        # no period: offline for good after the last window
        assert p.online(c, 10_000.0).tolist() == [True, False, False]

    def test_online_until(self):
        p = make([[], [[100, 200]], [[0, 50], [300, 400]]])
        u = p.online_until(np.arange(3), 120.0)
        assert u[0] == np.inf
        assert u[1] == 200.0
        assert u[2] == 120.0  # offline at t: until == t
        assert p.online_until([2], 310.0)[0] == 400.0

    def test_periodic_windows_repeat(self):
        day = 86_400.0
        p = make([[[3600, 7200]], [[0, 1000]]], period_s=day)
        for k in range(4):
            base = k * day
            assert p.online([0, 1], base + 3600.0).tolist() == [True, False]
            assert p.online([0, 1], base + 500.0).tolist() == [False, True]
            assert p.online([0, 1], base + 7200.0).tolist() == [False, False]
            assert p.online_until([0], base + 5000.0)[0] == base + 7200.0

    def test_wrap_around_midnight(self):
        day = 86_400.0
        # 22:00 -> 02:00, written as one window past the period end
        p = make([[[79_200, 93_600]]], period_s=day)
        np.testing.assert_array_equal(p.windows[0], [[0, 7200], [79_200, day]])
        assert p.online([0], 1000.0)[0] and p.online([0], 80_000.0)[0]
        assert not p.online([0], 50_000.0)[0]
        # at 23:00 on day 3 the client stays online until 02:00 on day 4
        t = 3 * day + 82_800.0
        assert p.online_until([0], t)[0] == 4 * day + 7200.0
        assert p.online_until([0], 4 * day + 3600)[0] == 4 * day + 7200.0

    def test_normalization_merge_full_and_never(self):
        p = make(
            [
                [[50, 80], [0, 60], [80, 90], [200, 300]],  # merged -> [0,90), [200,300)
                [[0, 100]],  # covers the whole period -> always online
                [[10, 10]],  # only an empty window -> never online
                [[900, 2000]],  # longer than a period -> always online
            ],
            period_s=100.0 * 10,
        )
        np.testing.assert_array_equal(p.windows[0], [[0, 90], [200, 300]])
        p2 = make([[[0, 1000]], [[0, 10]]], period_s=1000.0)
        assert p2.windows[0].shape == (0, 2) and p2.always_online.tolist() == [True, False]
        assert p.windows[2].tolist() == [[0.0, 0.0]]
        assert not p.online([2], 10.0)[0] and not p.online([2], 0.0)[0]
        assert p.online_until([2], 5.0)[0] == 5.0
        assert p.windows[3].shape == (0, 2) and p.online([3], 1234.5)[0]

    def test_per_client_periods(self):
        p = make([[[0, 10]], [[0, 10]]], period_s=np.array([100.0, 50.0]))
        assert p.online([0, 1], 55.0).tolist() == [False, True]
        assert p.online([0, 1], 105.0).tolist() == [True, True]
        assert p.online([0, 1], 180.0).tolist() == [False, False]
        assert p.online_until([0, 1], 155.0).tolist() == [155.0, 160.0]
        assert p.take([1]).period_s.tolist() == [50.0]

    def test_per_client_times(self):
        p = make([[[0, 10]], [[20, 30]]])
        assert p.online([0, 1], np.array([5.0, 25.0])).tolist() == [True, True]

    def test_matches_brute_force(self):
        rng = np.random.default_rng(7)
        m, period = 300, 1000.0
        wins = []
        for _ in range(m):
            k = rng.integers(0, 4)
            a = np.sort(rng.uniform(0, period, 2 * k)).reshape(-1, 2)
            wins.append(a)
        for per in (None, period):
            p = make(wins, period_s=per)
            clients = rng.permutation(m)[:200]
            for t in rng.uniform(0, 3 * period, 25):
                got = p.online(clients, t)
                want = [brute_online(wins[c], per, t) for c in clients]
                assert got.tolist() == want
                until = p.online_until(clients, t)
                assert np.all(until[got] > t) and np.all(until[~got] == t)
                # just before `until` the client is still online, at `until` it is not
                fin = got & np.isfinite(until)
                assert p.online(clients[fin], until[fin] - 1e-6).all()
                assert not p.online(clients[fin], until[fin]).any()

    def test_take_subset_and_repeat(self):
        p = make([[], [[1, 2]], [[3, 4], [5, 6]]])
        q = p.take([2, 0, 2])
        assert len(q) == 3
        np.testing.assert_array_equal(q.windows[0], [[3, 4], [5, 6]])
        assert q.windows[1].shape == (0, 2)
        assert q.online([0, 1, 2], 3.5).tolist() == [True, True, True]
        assert p.take(np.arange(7) % len(p)).ms_per_sample.shape == (7,)

    def test_bad_profiles(self):
        with pytest.raises(ProfileError, match=r"client 1.*ends before"):
            make([[], [[5, 1]]])
        with pytest.raises(ProfileError, match=r"ms_per_sample.*client 0"):
            Profiles(np.array([0.0]), np.ones(1), np.ones(1), np.zeros(1), [[]], None)
        with pytest.raises(ProfileError, match="period_s"):
            make([[]], period_s=-5)
        with pytest.raises(IndexError):
            make([[]]).online([3], 0.0)
        with pytest.raises(IndexError):
            make([[]]).online([-1], 0.0)


# --------------------------------------------------------------------------- distributions


class TestDistribution:
    def test_defaults_deterministic_per_seed(self):
        a = profiles_from_distribution(500, None, np.random.default_rng(1))
        b = profiles_from_distribution(500, {}, np.random.default_rng(1))
        c = profiles_from_distribution(500, {}, np.random.default_rng(2))
        for f in ("ms_per_sample", "up_bps", "down_bps", "latency_s"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert not np.array_equal(a.ms_per_sample, c.ms_per_sample)
        assert a.always_online.all()
        np.testing.assert_allclose(a.latency_s, 0.05)

    def test_lognormal_median(self):
        p = profiles_from_distribution(
            20_000,
            {"compute": {"dist": "lognormal", "median_ms_per_sample": 30.0, "sigma": 0.5}},
            np.random.default_rng(0),
        )
        assert abs(np.median(p.ms_per_sample) / 30.0 - 1) < 0.03
        assert abs(np.std(np.log(p.ms_per_sample)) - 0.5) < 0.02
        d = profiles_from_distribution(20_000, {}, np.random.default_rng(0))
        assert abs(np.median(d.ms_per_sample) / 20.0 - 1) < 0.03
        lat = profiles_from_distribution(
            20_000,
            {"latency_ms": {"dist": "lognormal", "median_ms": 80, "sigma": 0.3}},
            np.random.default_rng(3),
        ).latency_s
        assert abs(np.median(lat) / 0.080 - 1) < 0.03

    def test_constant_and_network_mix(self):
        spec = {
            "compute": {"dist": "constant", "ms_per_sample": 10},
            "network": [
                {"share": 0.25, "up_mbps": 1, "down_mbps": 8},
                {"share": 0.75, "up_mbps": 10, "down_mbps": 40},
            ],
        }
        p = profiles_from_distribution(8000, spec, np.random.default_rng(0))
        assert np.all(p.ms_per_sample == 10.0)
        slow = p.up_bps == 125_000.0  # 1 Mbit/s
        assert np.all(p.down_bps[slow] == 1_000_000.0)
        assert np.all(p.up_bps[~slow] == 1_250_000.0)
        assert abs(slow.mean() - 0.25) < 0.02

    def test_availability_windows_fraction(self):
        spec = {"availability": {"dist": "windows", "online_fraction": 0.7, "period_s": 3600, "windows_per_period": 3}}
        p = profiles_from_distribution(400, spec, np.random.default_rng(5))
        q = profiles_from_distribution(400, spec, np.random.default_rng(5))
        assert p.period_s == 3600.0
        for a, b in zip(p.windows, q.windows, strict=True):
            np.testing.assert_array_equal(a, b)
        covered = np.array([np.sum(w[:, 1] - w[:, 0]) for w in p.windows])
        np.testing.assert_allclose(covered, 0.7 * 3600)
        ts = np.linspace(0, 3600, 360, endpoint=False)
        frac = np.mean([p.online(np.arange(400), t).mean() for t in ts])
        assert abs(frac - 0.7) < 0.02
        # periodic: same pattern an hour later
        assert p.online(np.arange(400), 100.0).tolist() == p.online(np.arange(400), 3700.0).tolist()
        full = profiles_from_distribution(
            10, {"availability": {"dist": "windows", "online_fraction": 1.0}}, np.random.default_rng(0)
        )
        assert full.always_online.all()

    @pytest.mark.parametrize(
        "spec, key",
        [
            ({"computee": {}}, "computee"),
            ({"compute": {"dist": "lognormal", "median": 3}}, "compute.median"),
            ({"compute": {"dist": "gamma"}}, "compute.dist"),
            ({"compute": {"dist": "lognormal", "sigma": -1}}, "compute.sigma"),
            ({"compute": {"dist": "constant", "ms_per_sample": "fast"}}, "compute.ms_per_sample"),
            ({"network": [{"share": 1.0, "up_mbps": 1, "down": 2}]}, r"network\[0\].down"),
            ({"network": [{"share": 0.5, "up_mbps": 1, "down_mbps": 2}]}, "share"),
            ({"network": [{"share": 1.0, "up_mbps": 0, "down_mbps": 2}]}, r"network\[0\].up_mbps"),
            ({"latency_ms": {"dist": "constant", "value": -3}}, "latency_ms.value"),
            ({"availability": {"dist": "windows", "online_fraction": 1.5}}, "online_fraction"),
            ({"availability": {"dist": "windows", "windows_per_period": 0}}, "windows_per_period"),
            ({"availability": {"dist": "always", "period_s": 5}}, "availability.period_s"),
        ],
    )
    def test_bad_spec_names_key(self, spec, key):
        with pytest.raises(ProfileError, match=key):
            profiles_from_distribution(10, spec, np.random.default_rng(0))


# --------------------------------------------------------------------------- trace files


class TestTraceFiles:
    def test_shipped_example(self):
        p = load_trace(EXAMPLE)
        assert len(p) == 20
        assert p.period_s == 86_400.0
        assert p.ms_per_sample[0] == 12.5
        assert p.up_bps[0] == 18_000 * 125.0 and p.down_bps[0] == 95_000 * 125.0
        assert p.latency_s[0] == pytest.approx(0.025)
        assert p.always_online.sum() == 7
        np.testing.assert_array_equal(p.windows[2], [[0, 25_200], [79_200, 86_400]])
        # client 3 is online 00:00-06:00 only; client 2 wraps around midnight
        assert p.online([3], 86_400 * 2 + 100)[0] and not p.online([3], 86_400 * 2 + 30_000)[0]
        assert p.online_until([2], 80_000.0)[0] == 86_400 + 25_200

    def test_csv_roundtrip_any_row_order(self, tmp_path):
        f = tmp_path / "t.csv"
        f.write_text(
            "latency_ms,client,ms_per_sample,up_kbps,down_kbps,windows\n"
            "10,1,20,1000,8000,0-3600;7200-9000\n"
            "0,0,5.5,8000,16000,\n"
        )
        p = load_trace(f)
        assert p.period_s is None
        assert p.ms_per_sample.tolist() == [5.5, 20.0]
        assert p.up_bps.tolist() == [1_000_000.0, 125_000.0]
        assert p.latency_s.tolist() == [0.0, 0.01]
        np.testing.assert_array_equal(p.windows[1], [[0, 3600], [7200, 9000]])
        assert p.online([0, 1], 5000.0).tolist() == [True, False]
        assert p.online([0, 1], 20_000.0).tolist() == [True, False]

    def test_csv_period_directive(self, tmp_path):
        f = tmp_path / "t.csv"
        f.write_text(
            "# comment\n#period_s = 100\nclient,ms_per_sample,up_kbps,down_kbps,latency_ms,windows\n0,1,1,1,1,0-10\n"
        )
        p = load_trace(f)
        assert p.period_s == 100.0 and p.online([0], 205.0)[0]

    @pytest.mark.parametrize(
        "row, pattern",
        [
            ("0,abc,1000,8000,10,", r"line 2.*'ms_per_sample'"),
            ("0,20,-5,8000,10,", r"line 2.*'up_kbps'"),
            ("0,20,1000,8000,-1,", r"line 2.*'latency_ms'"),
            ("0,20,1000,8000,10,5-", r"line 2.*'windows'"),
            ("0,20,1000,8000,10,50-10", r"line 2.*'windows'.*before"),
            ("x,20,1000,8000,10,", r"line 2.*'client'"),
            ("0,20,1000,8000", r"line 2.*fields"),
        ],
    )
    def test_bad_csv_field_names_file_and_field(self, tmp_path, row, pattern):
        f = tmp_path / "bad_devices.csv"
        f.write_text("client,ms_per_sample,up_kbps,down_kbps,latency_ms,windows\n" + row + "\n")
        with pytest.raises(ProfileError, match=r"bad_devices\.csv") as ei:
            load_trace(f)
        assert __import__("re").search(pattern, str(ei.value)), str(ei.value)

    def test_bad_csv_structure(self, tmp_path):
        f = tmp_path / "d.csv"
        f.write_text("client,ms_per_sample,up_kbps,down_kbps,latency_ms,windows,gpu\n")
        with pytest.raises(ProfileError, match=r"d\.csv.*unknown column 'gpu'"):
            load_trace(f)
        f.write_text("client,ms_per_sample,up_kbps,down_kbps,windows\n")
        with pytest.raises(ProfileError, match="missing column 'latency_ms'"):
            load_trace(f)
        hdr = "client,ms_per_sample,up_kbps,down_kbps,latency_ms,windows\n"
        f.write_text(hdr + "0,1,1,1,1,\n0,1,1,1,1,\n")
        with pytest.raises(ProfileError, match="duplicate client id 0"):
            load_trace(f)
        f.write_text(hdr + "0,1,1,1,1,\n2,1,1,1,1,\n")
        with pytest.raises(ProfileError, match=r"0\.\.1.*missing \[1\]"):
            load_trace(f)
        f.write_text("")
        with pytest.raises(ProfileError, match="no header"):
            load_trace(f)

    def test_json(self, tmp_path):
        doc = {
            "period_s": 86400,
            "clients": [
                {
                    "client": 1,
                    "ms_per_sample": 20,
                    "up_kbps": 1000,
                    "down_kbps": 8000,
                    "latency_ms": 10,
                    "windows": [[0, 3600], [7200, 9000]],
                },
                {"client": 0, "ms_per_sample": 5, "up_kbps": 8000, "down_kbps": 16000, "latency_ms": 0},
            ],
        }
        f = tmp_path / "t.json"
        f.write_text(json.dumps(doc))
        p = load_trace(f)
        assert p.period_s == 86400.0
        assert p.ms_per_sample.tolist() == [5.0, 20.0]
        assert p.down_bps.tolist() == [2_000_000.0, 1_000_000.0]
        assert p.online([1], 86400 + 8000.0)[0]
        doc["clients"][0]["up_kbps"] = "fast"
        f.write_text(json.dumps(doc))
        with pytest.raises(ProfileError, match=r"t.json.*clients\[0\] \(client 1\).*'up_kbps'"):
            load_trace(f)
        doc["clients"][0]["up_kbps"] = 1000
        doc["clients"][0]["gpu"] = True
        f.write_text(json.dumps(doc))
        with pytest.raises(ProfileError, match="unknown field 'gpu'"):
            load_trace(f)

    def test_csv_and_json_agree(self, tmp_path):
        p = load_trace(EXAMPLE)
        clients = []
        for i in range(len(p)):
            clients.append(
                {
                    "client": i,
                    "ms_per_sample": float(p.ms_per_sample[i]),
                    "up_kbps": float(p.up_bps[i] / 125),
                    "down_kbps": float(p.down_bps[i] / 125),
                    "latency_ms": float(p.latency_s[i] * 1000),
                    "windows": p.windows[i].tolist(),
                }
            )
        f = tmp_path / "ex.json"
        f.write_text(json.dumps({"period_s": 86400, "clients": clients}))
        q = load_trace(f)
        np.testing.assert_allclose(q.up_bps, p.up_bps)
        for a, b in zip(p.windows, q.windows, strict=True):
            np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- FedScale


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


class TestFedScale:
    def write(self, path, obj):
        with open(path, "wb") as fh:
            pickle.dump(obj, fh)
        return path

    def test_capacity_only(self, tmp_path):
        cap = self.write(
            tmp_path / "client_device_capacity",
            {
                7: {"computation": 30.0, "communication": 800.0},
                2: {"computation": 12.0, "communication": 4000},
                5: {"computation": 55.5, "communication": 1200.0},
            },
        )
        p = import_fedscale(cap)
        assert len(p) == 3
        assert p.ms_per_sample.tolist() == [12.0, 55.5, 30.0]  # sorted keys 2, 5, 7
        assert p.up_bps.tolist() == [500_000.0, 150_000.0, 100_000.0]  # kbps * 125
        np.testing.assert_array_equal(p.up_bps, p.down_bps)
        assert np.all(p.latency_s == 0) and p.always_online.all()
        q = import_fedscale(cap, kbit_bits=1024)
        assert q.up_bps[0] == 4000 * 128.0

    def test_with_behaviour_trace(self, tmp_path):
        cap = self.write(
            tmp_path / "cap.pkl",
            {
                1: {"computation": 10.0, "communication": 1000.0},
                2: {"computation": 20.0, "communication": 1000.0},
            },
        )
        beh = self.write(
            tmp_path / "beh.pkl",
            {
                2: {"duration": 500, "active": [100, 400], "inactive": [200, 500], "finish_time": 1000},
                1: {"duration": 900, "active": [0], "inactive": [900], "finish_time": 1000},
            },
        )
        p = import_fedscale(cap, beh)
        assert p.period_s == 1000.0
        np.testing.assert_array_equal(p.windows[1], [[100, 200], [400, 500]])
        assert p.online([0, 1], 150.0).tolist() == [True, True]
        assert p.online([0, 1], 300.0).tolist() == [True, False]
        assert p.online([0, 1], 1950.0).tolist() == [False, False]
        assert p.online([0, 1], 2450.0).tolist() == [True, True]
        assert p.online_until([1], 2450.0)[0] == 2500.0

    def test_cycled_traces_and_per_client_period(self, tmp_path):
        cap = self.write(tmp_path / "cap.pkl", {i: {"computation": 10.0, "communication": 100.0} for i in range(5)})
        beh = self.write(
            tmp_path / "beh.pkl",
            {
                "a": {"active": [0], "inactive": [10], "finish_time": 100, "duration": 10},
                "b": {"active": [50, 80], "inactive": [60], "finish_time": 200, "duration": 30},
            },
        )
        p = import_fedscale(cap, beh)
        assert len(p) == 5
        np.testing.assert_array_equal(p.period_s, [100, 200, 100, 200, 100])
        np.testing.assert_array_equal(p.windows[1], [[50, 60], [80, 200]])
        np.testing.assert_array_equal(p.windows[4], [[0, 10]])

    def test_bad_structure_names_file_and_field(self, tmp_path):
        cap = self.write(tmp_path / "cap.pkl", {1: {"computation": 10.0}})
        with pytest.raises(ProfileError, match=r"cap.pkl: client 1: missing field 'communication'"):
            import_fedscale(cap)
        cap = self.write(tmp_path / "cap.pkl", {1: {"computation": "x", "communication": 1}})
        with pytest.raises(ProfileError, match=r"cap.pkl: client 1, field 'computation'"):
            import_fedscale(cap)
        cap = self.write(tmp_path / "cap.pkl", {1: {"computation": 1.0, "communication": 1}})
        beh = self.write(tmp_path / "beh.pkl", {1: {"active": [5, 6, 7], "inactive": [1], "finish_time": 10}})
        with pytest.raises(ProfileError, match=r"beh.pkl: client 1.*'active' has 3"):
            import_fedscale(cap, beh)
        beh = self.write(tmp_path / "beh.pkl", {1: {"active": [5], "inactive": [1], "finish_time": 10}})
        with pytest.raises(ProfileError, match=r"beh.pkl: client 1.*before"):
            import_fedscale(cap, beh)
        (tmp_path / "junk.pkl").write_bytes(b"not a pickle at all")
        with pytest.raises(ProfileError, match=r"junk\.pkl"):
            import_fedscale(tmp_path / "junk.pkl")

    def test_malicious_pickle_rejected_without_executing(self, tmp_path):
        marker = tmp_path / "pwned"
        _Evil.marker = marker
        evil = self.write(tmp_path / "client_device_capacity", {1: {"computation": _Evil(), "communication": 1.0}})
        with pytest.raises(ProfileError, match=r"client_device_capacity.*refused.*system"):
            import_fedscale(evil)
        assert not marker.exists()
        cap = self.write(tmp_path / "cap.pkl", {1: {"computation": 1.0, "communication": 1.0}})
        with pytest.raises(ProfileError, match=r"evil_beh.*refused"):
            import_fedscale(cap, self.write(tmp_path / "evil_beh", _Evil()))
        assert not marker.exists()

    def test_any_global_is_refused(self, tmp_path):
        from collections import OrderedDict

        f = self.write(tmp_path / "od.pkl", OrderedDict({1: {"computation": 1.0, "communication": 1.0}}))
        with pytest.raises(ProfileError, match=r"od.pkl.*collections.OrderedDict"):
            import_fedscale(f)
