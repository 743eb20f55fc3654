"""megatron_rl.compat.tensorboard_s3: TensorBoard's file layer imported without boto3, which stays usable; and the
patch is still needed (without it, TensorBoard imports boto3)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two fresh interpreters importing TensorBoard

PROBE = """
import json, sys
import megatron_rl
from megatron_rl.compat import tensorboard_s3
if sys.argv[1] == "off":
    tensorboard_s3.uninstall()
from tensorboard.compat.tensorflow_stub.io import gfile
seen = {"boto3_imported": "boto3" in sys.modules, "s3_enabled": gfile.S3_ENABLED}
import boto3  # the S3 trajectory store's import afterwards
seen["boto3_usable"] = callable(boto3.client)
print(json.dumps(seen))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tensorboard_is_imported_without_boto3_which_stays_usable():
    assert _probe("on") == {"boto3_imported": False, "s3_enabled": False, "boto3_usable": True}


def test_still_needed_tensorboard_imports_boto3_by_itself():
    assert _probe("off") == {"boto3_imported": True, "s3_enabled": True, "boto3_usable": True}
