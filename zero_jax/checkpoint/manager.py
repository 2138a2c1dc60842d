"""Sharded checkpoints with orbax: async, atomic, verified, restorable onto any layout.

A checkpoint of step N is the directory N/ with four items:

    params, opt_state, scalars   the train state; every process writes the
                                 shards it holds (orbax PyTree items)
    meta                         JSON: run config, data position, and a manifest
                                 of every array (shape, dtype, checksum)

Saving is asynchronous: `save` returns once the arrays are copied off the
devices, and the commit runs while training continues. Commit is atomic:
orbax writes `N.orbax-checkpoint-tmp-*`, renames it to N and writes a commit
marker; only a directory with its marker counts as complete.

Restore always targets the current run's abstract state with its shardings,
so a checkpoint restores under any mesh, ZeRO stage, tensor layout or
process count. The tree, shapes and dtypes are compared with the manifest
first (orbax would cast dtypes silently; we never do) and every restored
array is checked against its checksum (orbax would restore a flipped bit
silently).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from zero_jax.checkpoint import integrity
from zero_jax.config.sections import CheckpointConfig
from zero_jax.sharding.specs import map_specs, path_name
from zero_jax.train.state import TrainState, saved_form

COMMIT_MARKER = "commit_success.txt"
FORMAT = 1  # bumped when the layout of `meta` changes


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; names the step."""

    def __init__(self, directory: Path, step: int, message: str):
        super().__init__(f"checkpoint step {step} in {directory}: {message}")
        self.step = step


class IncompatibleCheckpoint(CheckpointError):
    """Tree, shape or dtype differs from the model being restored into."""


class CorruptCheckpoint(CheckpointError):
    """Data that does not read back, or reads back different from what was saved."""


class SaveFailed(CheckpointError):
    """A save that did not commit (disk full, permissions...); earlier steps are intact."""


def items_of(state: TrainState) -> dict[str, Any]:
    """The items of a checkpoint: the state's saved form (master weights, no
    working copy), the same whichever layout wrote it."""
    state = saved_form(state)
    return {"params": state.params, "opt_state": state.opt_state,
            "scalars": {"step": state.step, "loss_scale": state.loss_scale}}


def state_of(items: dict[str, Any]) -> TrainState:
    """The saved form back from the items (`StatePlan.from_saved` makes a state of it)."""
    s = items["scalars"]
    return TrainState(s["step"], items["params"], items["opt_state"], s["loss_scale"])


def manifest(items: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{item: {path: {shape, dtype, checksum}}} of the arrays in `items`."""
    sums = integrity.checksums(items)
    out: dict[str, dict[str, Any]] = {name: {} for name in items}
    for path, leaf in integrity.flatten(items).items():
        item, _, rest = path.partition(".")
        out[item][rest] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype),
                           "checksum": sums[path]}
    return out


def compare(target: dict[str, Any], saved: dict[str, dict[str, Any]]) -> list[str]:
    """Leaves where the target (abstract) items differ from a manifest."""
    problems = []
    for item, abstract in target.items():
        want = {p: (list(x.shape), str(x.dtype)) for p, x in integrity.flatten(abstract).items()}
        have = {p: (m["shape"], m["dtype"]) for p, m in saved.get(item, {}).items()}
        problems += [f"{item}.{p}: in the model, not in the checkpoint" for p in sorted(want.keys() - have.keys())]
        problems += [f"{item}.{p}: in the checkpoint, not in the model" for p in sorted(have.keys() - want.keys())]
        for p in sorted(want.keys() & have.keys()):
            (ws, wd), (hs, hd) = want[p], have[p]
            if ws != hs:
                problems.append(f"{item}.{p}: shape {tuple(hs)} saved, {tuple(ws)} in the model")
            if wd != hd:
                problems.append(f"{item}.{p}: dtype {hd} saved, {wd} in the model")
    return problems


def read_meta(step_dir: Path) -> dict[str, Any]:
    """A step's meta item, which lists its arrays; a committed step without a
    readable one is damaged, not of another format. The one reader of it:
    restores and streaming exports alike."""
    path = step_dir / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
        meta["manifest"]["params"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        step = int(step_dir.name) if step_dir.name.isdigit() else -1
        raise CorruptCheckpoint(step_dir.parent, step,
                                f"its meta item {path} is unreadable ({reason})") from None
    return meta


def layer_chunks(names: Any) -> Any:
    """Save arguments that store each layer of a scanned stack as its own chunk.

    Orbax writes a shard as one chunk by default, which for a stacked array
    spans every layer: reading one layer (a streaming export) would read the
    whole array. `names` is the parameters' tree of logical-name specs.
    """
    return map_specs(
        lambda spec: ocp.SaveArgs(shard_axes=(0,)) if len(spec) and spec[0] == "layers"
        else ocp.SaveArgs(), names)


def complete_steps(directory: str | Path) -> list[int]:
    """Steps whose directory and commit marker exist, oldest first (reads only)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(int(d.name) for d in directory.iterdir()
                  if d.is_dir() and d.name.isdigit() and (d / COMMIT_MARKER).exists())


def incomplete(directory: str | Path) -> list[str]:
    """Directory names of saves that never committed (killed, failed)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(d.name for d in directory.iterdir()
                  if d.is_dir() and ((d.name.isdigit() and not (d / COMMIT_MARKER).exists())
                                     or ".orbax-checkpoint-tmp" in d.name))


class Checkpointer:
    """Save, list, verify and restore the checkpoints in one directory.

    Only the run that writes a directory (`writer=True`) removes what an
    interrupted save left behind; a reader (an export, another run's
    --init-from) must never touch a directory another process may be writing.
    """

    def __init__(self, cfg: CheckpointConfig, param_names: Any = None, writer: bool = False,
                 barrier_timeout_s: int = 600, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        # Called with each step whose save has committed, on every process, as
        # the commit is noticed: a run's metric writers make their records
        # up to it durable there (metrics.Writers.committed).
        self.on_commit: Callable[[int], None] = lambda step: None
        self._saving: list[tuple[int, float]] = []  # (step, its start time) not yet logged
        self._param_save_args = None if param_names is None else layer_chunks(param_names)
        self.directory = Path(cfg.dir).absolute()
        # A writer's manager deletes what interrupted saves left as it starts
        # (sometimes before, sometimes after it returns): note them first, so
        # that a resume can always say which save never committed.
        self.interrupted = self.incomplete()
        options = _manager_options(cfg, writer, barrier_timeout_s)
        if not writer:  # a reader's manager is read-only by design: orbax's warning says only that
            _absl_logger().addFilter(_quiet_read_only)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # -- listing -----------------------------------------------------------
    def complete_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def incomplete(self) -> list[str]:
        return incomplete(self.directory)

    # -- saving ------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> None:
        """Start saving `state` as `step`; returns once the arrays are off the devices.

        `state` is in its saved form (`StatePlan.saved_form`: a pipeline's layer
        stacks in layer order), or a state without a pipeline's cut."""
        self.check()
        started = time.time()
        items = items_of(state)
        record = {"format": FORMAT, "step": step, "manifest": manifest(items), **meta}
        args = {name: ocp.args.PyTreeSave(tree) for name, tree in items.items()}
        args["params"] = ocp.args.PyTreeSave(items["params"], save_args=self._param_save_args)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                **args, meta=ocp.args.JsonSave(record)), force=True)
        except Exception as e:  # noqa: BLE001 - orbax re-raises a failed commit here
            raise self._failed(e, step) from e
        self._in_flight = step
        self._saving.append((step, started))
        self._log_committed()  # a synchronous save has committed already

    def check(self) -> None:
        """Raise SaveFailed if a background commit failed; log those that committed."""
        self._settle(self.manager.check_for_errors)

    def wait(self) -> None:
        """Wait for the saves still committing; SaveFailed if one did not."""
        self._settle(self.manager.wait_until_finished)

    def _settle(self, call: Callable[[], None]) -> None:
        """`call` orbax, a failed commit re-raised as SaveFailed; then log the committed saves."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - orbax re-raises a failed commit as it was
            raise self._failed(e) from e
        self._log_committed()

    def _log_committed(self) -> None:
        """One line per save whose commit marker has appeared since the last
        call (saves commit in the background), from the first process only;
        `on_commit` hears of each on every process."""
        for step, started in list(self._saving):
            marker = self.directory / str(step) / COMMIT_MARKER
            if not marker.exists():
                continue
            self._saving.remove((step, started))
            if jax.process_index() == 0:
                self.log(describe_save(self.directory / str(step),
                                       marker.stat().st_mtime - started))
            self.on_commit(step)

    _in_flight: int | None = None

    def _failed(self, error: Exception, step: int | None = None) -> SaveFailed:
        failed = self._in_flight if self._in_flight is not None else step
        cause = str(error).splitlines()[0]
        reason = next((cause[i:] for i in [cause.rfind("Failed to write")] if i >= 0), cause)
        return SaveFailed(self.directory, -1 if failed is None else failed,
                          f"the save did not commit ({reason[:300]}); earlier checkpoints are "
                          f"intact: {complete_steps(self.directory)}")

    def remove_incomplete(self) -> list[str]:
        """Delete the directories of saves that did not commit; returns their names.

        Waits first for a save still writing in the background (a later step
        than the one that failed), so that nothing recreates what is removed."""
        try:
            self.manager.wait_until_finished()
        except Exception:  # noqa: BLE001 - the failure is being reported already
            pass
        gone = self.incomplete()
        if jax.process_index() == 0:
            for name in gone:
                shutil.rmtree(self.directory / name, ignore_errors=True)
        return gone

    # -- restoring ---------------------------------------------------------
    def meta(self, step: int) -> dict[str, Any]:
        return read_meta(self.directory / str(step))

    def restore(self, step: int, target: TrainState, params_only: bool = False):
        """(saved state or master weights, meta) of `step`, laid out as
        `target` and verified.

        `target` is the current run's abstract saved form (`StatePlan.targets`),
        each leaf a ShapeDtypeStruct with its sharding.
        """
        meta = self.meta(step)
        wanted = items_of(target)
        if params_only:
            wanted = {"params": wanted["params"]}
        problems = compare(wanted, meta["manifest"])
        if problems:
            listed = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
            raise IncompatibleCheckpoint(
                self.directory, step, f"does not match the model ({len(problems)} leaves):\n  "
                f"{listed}\nrestore with the model, optimizer and precision it was saved "
                "with, or only its parameters into a new optimizer (--init-from)")
        restored = self._read(step, wanted)
        self._verify(step, restored, meta["manifest"])
        return (restored["params"] if params_only else state_of(restored)), meta

    def _read(self, step: int, wanted: dict[str, Any]) -> dict[str, Any]:
        args = {name: ocp.args.PyTreeRestore(
                    item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
                for name, tree in wanted.items()}
        try:
            return dict(self.manager.restore(step, args=ocp.args.Composite(**args)).items())
        except Exception as e:  # noqa: BLE001 - tensorstore/orbax errors vary
            bad = self._unreadable(step, wanted)
            raise CorruptCheckpoint(
                self.directory, step,
                f"cannot read {', '.join(bad) or 'its data'} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]})") from e

    def _unreadable(self, step: int, wanted: dict[str, Any]) -> list[str]:
        """Arrays that fail to read on their own: the names for the error."""
        bad = []
        for item, tree in wanted.items():
            for path in integrity.flatten(tree):
                one = _only(tree, path)
                args = jax.tree.map(lambda x: x if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
                    sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), one)
                try:
                    self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeRestore(
                        item=one, restore_args=args)}))
                except Exception:  # noqa: BLE001
                    bad.append(f"{item}.{path}")
        return bad

    def _verify(self, step: int, restored: dict[str, Any], saved: dict[str, dict[str, Any]]) -> None:
        sums = integrity.checksums(restored)
        bad = [path for path, s in sums.items()
               if saved[path.partition(".")[0]][path.partition(".")[2]]["checksum"] != s]
        if bad:
            raise CorruptCheckpoint(self.directory, step,
                                    f"checksum mismatch in {', '.join(bad)}: the data on disk "
                                    "is not what was saved")

    def restore_latest(self, target: TrainState, log: Callable[[str], None] = print):
        """(state, meta) from the newest complete checkpoint that verifies, or None.

        A corrupt checkpoint is reported and the previous complete one tried.
        """
        for name in self.interrupted:
            log(f"checkpoint {self.directory / name}: never committed (interrupted save); ignored")
        for step in reversed(self.complete_steps()):
            try:
                return self.restore(step, target)
            except CorruptCheckpoint as e:
                log(f"{e}\nfalling back to the previous complete checkpoint")
        return None

    def close(self) -> None:
        self.manager.close()


def _manager_options(cfg: CheckpointConfig, writer: bool,
                     barrier_timeout_s: int) -> ocp.CheckpointManagerOptions:
    """A writer's options, or a reader's: read-only, and without the saving
    settings, which orbax would otherwise drop with a warning for each."""
    # Orbax's own barriers between processes give up after barrier_timeout_s.
    timeouts = ocp.AsyncOptions(timeout_secs=barrier_timeout_s)
    if not writer:
        return ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0,
                                            max_to_keep=None, create=False,
                                            cleanup_tmp_directories=False,
                                            async_options=timeouts)
    return ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_last, keep_period=cfg.keep_every or None,
        enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True, create=True,
        async_options=timeouts)


def describe_save(step_dir: Path, seconds: float) -> str:
    """The line a committed save is logged with: where, its bytes on disk, how long."""
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    return (f"checkpoint step {step_dir.name} saved in {step_dir} ({size / 2**20:,.1f} MiB, "
            f"committed {max(seconds, 0):.1f} s after the save began)")


def _absl_logger():
    from absl import logging as absl_logging  # orbax logs through absl

    return absl_logging.get_absl_logger()


def _quiet_read_only(record) -> bool:
    """A logging filter: drops orbax's "Given directory is read only" warning,
    which every checkpoint opened for reading (restores, --init-from,
    exports) would print; every other record passes."""
    return not str(record.msg).startswith("Given directory is read only")


def _only(tree: Any, path: str) -> Any:
    """`tree` with every leaf but the one at `path` replaced by orbax's PLACEHOLDER."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if path_name(p) == path else ocp.PLACEHOLDER, tree)
