"""The long poll's versioned values (sessions/changes.py): at once when behind, else the first change, bounded."""

from __future__ import annotations

import anyio
import pytest

from coderunner.sessions.changes import Changes, ChangesFull

pytestmark = pytest.mark.anyio


async def test_what_differs_comes_back_at_once_and_only_the_latest_value() -> None:
    changes = Changes()
    changes.publish("a", {"n": 1})
    second = changes.publish("a", {"n": 2})
    changes.publish("b", "x")
    found = await changes.changes_since({"a": None, "b": changes.version("b")}, timeout_s=30)
    assert found.values == {"a": (second, {"n": 2})} and found.gone == []


async def test_a_reader_that_is_up_to_date_waits_for_the_first_change_of_its_keys_only() -> None:
    changes = Changes()
    seen = {"a": changes.publish("a", 0), "b": changes.publish("b", 0)}
    answers = []

    async def reader() -> None:
        answers.append(await changes.changes_since(seen, timeout_s=30))

    async with anyio.create_task_group() as group:
        group.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        changes.publish("other", 1)  # not asked about: the wait goes on
        await anyio.wait_all_tasks_blocked()
        assert answers == []
        version = changes.publish("b", 1)
    (found,) = answers
    assert found.values == {"b": (version, 1)}


async def test_a_wait_with_nothing_new_ends_at_its_bound_empty() -> None:
    changes = Changes()
    seen = {"a": changes.publish("a", 0)}
    with anyio.fail_after(5):
        found = await changes.changes_since(seen, timeout_s=0.05)
    assert not found


async def test_a_dropped_or_unknown_key_is_gone_at_once_and_wakes_a_wait() -> None:
    changes = Changes()
    seen = {"a": changes.publish("a", 0)}
    assert (await changes.changes_since({"never": None}, timeout_s=30)).gone == ["never"]
    answers = []

    async def reader() -> None:
        answers.append(await changes.changes_since(seen, timeout_s=30))

    async with anyio.create_task_group() as group:
        group.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        changes.drop("a")
    assert answers[0].gone == ["a"] and len(changes) == 0


async def test_a_wait_is_woken_by_its_name_even_when_the_wake_came_first() -> None:
    changes = Changes()
    seen = {"a": changes.publish("a", 0)}
    answers = []

    async def reader() -> None:
        answers.append(await changes.changes_since(seen, timeout_s=30, waiter="w1"))

    async with anyio.create_task_group() as group:
        group.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        changes.wake("w1")
    assert answers and not answers[0]
    changes.wake("w2")  # before its wait: kept for it
    with anyio.fail_after(5):
        assert not await changes.changes_since(seen, timeout_s=30, waiter="w2")
    with anyio.fail_after(5), pytest.raises(TimeoutError), anyio.fail_after(0.1):
        await changes.changes_since(seen, timeout_s=30, waiter="w2")  # that wake was used once


async def test_a_restarted_publisher_s_versions_never_match_the_old_ones() -> None:
    old, new = Changes(), Changes()
    seen = {"a": old.publish("a", "old")}
    new.publish("a", "new")
    assert (await new.changes_since(seen, timeout_s=30)).values["a"][1] == "new"


async def test_keys_and_waits_are_bounded_with_a_clear_error() -> None:
    changes = Changes(max_keys=2, max_waiters=1)
    changes.publish("a", 0)
    changes.publish("b", 0)
    changes.publish("a", 1)  # a held key may change
    with pytest.raises(ChangesFull, match="2 keys are held"):
        changes.publish("c", 0)
    seen = {"a": changes.version("a")}
    async with anyio.create_task_group() as group:
        group.start_soon(changes.changes_since, seen, 30)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(ChangesFull, match="1 waits are under way"):
            await changes.changes_since(seen, 30)
        changes.publish("a", 2)
    assert not changes._waits and not changes._named and changes._waiting == 0  # nothing left behind
