"""Stop-string matching: the set-per-length matcher equals its find-per-string twin, and its cost
does not grow with the number of stop strings."""
import random
import time

from pdserve.common.stop import StopStrings, first_slow


def test_fast_matcher_equals_its_twin_on_random_growth():
    rng = random.Random(0)
    alphabet = "ab c"
    for trial in range(3000):
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        fast = StopStrings(stops)
        text = ""
        while len(text) < 40:
            start = len(text)
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            want = first_slow(stops, text, start)
            assert fast.first(text, start) == want, (stops, text, start)
            if want is not None:
                break


def test_cost_does_not_grow_with_the_list():
    text = "x" * 300 + "tail"
    few = StopStrings([f"s{i:05d}" for i in range(10)])
    many = StopStrings([f"s{i:05d}" for i in range(200_000)])  # same lengths, 20,000x the strings

    def per_call(m) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            assert m.first(text, len(text) - 4) is None
        return (time.perf_counter() - t0) / 200

    per_call(few), per_call(many)  # warm
    assert per_call(many) < 5 * per_call(few) + 1e-4
