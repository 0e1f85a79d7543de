import asyncio

from gpuguard.profiles.wait import wait_for_gpus


def test_wait_returns_once_enough_gpus_are_present():
    seen = iter([(["a"], ["b"]), (["a"], ["b"]), (["a", "b"], [])])

    async def look():
        return next(seen)

    r = asyncio.run(wait_for_gpus(look, 2, timeout=10, interval=0.01))
    assert r.complete and r.present == ("a", "b")


def test_wait_timeout_names_the_missing_gpus():
    async def look():
        return ["r9700-a", "xtx-a", "xtx-b"], ["r9700-b"]

    r = asyncio.run(wait_for_gpus(look, 4, timeout=0.2, interval=0.02))
    assert not r.complete and r.waited_seconds >= 0.2
    assert "only 3 of 4 GPUs present" in r.message() and "missing: r9700-b" in r.message()
