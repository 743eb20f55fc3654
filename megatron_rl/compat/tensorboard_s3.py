"""TensorBoard's import without boto3: its S3 file system off, 1-3 CPU-s saved in every process of a rank.

TensorBoard's file layer (`tensorboard.compat.tensorflow_stub.io.gfile`) imports botocore and boto3 whenever they
are installed, to offer `s3://` event-file paths. Megatron-Core imports it in every process that imports Megatron
(`megatron.core.timers` -> `torch.utils.tensorboard`), and this project installs boto3 for its S3 trajectory store
(`episodes.store: s3`): 1.2-2.9 CPU-s of imports per rank and per converter (measured with `python -X importtime`;
the higher figure on a loaded machine), for a feature nothing here uses (the Monitor writes `<run>/tb` on a local or
shared filesystem; `s3://` TensorBoard paths are not offered).

While that one module is being imported, and only if botocore is not imported already (then it would cost
nothing), `botocore` and `boto3` are hidden from it (`import` raises ImportError, so its `S3_ENABLED` is False);
they are restored at once, and the S3 store imports them normally when it is used. `install()` is called by
`megatron_rl/__init__.py`. `tests/compat/test_tensorboard_s3.py` fails when TensorBoard stops importing boto3
(the patch can then go) and when the patch leaves boto3 unusable.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "tensorboard.compat.tensorflow_stub.io.gfile"
HIDDEN = ("botocore", "boto3")


class _GfileImport(importlib.abc.MetaPathFinder):
    """Finds MODULE once (with the normal path finder) and runs its import with botocore and boto3 hidden."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module") or "botocore" in sys.modules:
            return spec
        exec_module = spec.loader.exec_module

        def exec_without_boto(module):
            for mod in HIDDEN:
                sys.modules.setdefault(mod, None)  # None in sys.modules: `import` raises ImportError
            try:
                exec_module(module)
            finally:
                for mod in HIDDEN:
                    if sys.modules.get(mod, 0) is None:
                        del sys.modules[mod]

        spec.loader.exec_module = exec_without_boto
        return spec


_FINDER = _GfileImport()


def install() -> None:
    """Hide boto3 from the coming import of TensorBoard's file layer (no-op if it is imported already)."""
    if MODULE not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
