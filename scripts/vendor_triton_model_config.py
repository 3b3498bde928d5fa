"""Rewrite fxport/serving/triton_model_config.py from a tritonclient wheel on PyPI.

    python scripts/vendor_triton_model_config.py [VERSION]      (default: 2.73.0)

Takes the serialized FileDescriptorProto of Triton's model_config.proto out of the wheel's
tritonclient/grpc/model_config_pb2.py, and Triton's license with it.
"""

from __future__ import annotations

import ast
import base64
import re
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "fxport" / "serving" / "triton_model_config.py"


def main(version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        f"tritonclient=={version}"], check=True)
        wheel = zipfile.ZipFile(next(Path(tmp).glob("tritonclient-*.whl")))
        names = wheel.namelist()
        src = wheel.read(next(n for n in names if n.endswith("tritonclient/grpc/model_config_pb2.py"))).decode()
        license_text = wheel.read(next(n for n in names if n.endswith("LICENSE.txt"))).decode().strip()
    found = re.search(r"AddSerializedFile\((b'.*?')\)\n", src, re.S)
    assert found, "the wheel's model_config_pb2.py has no serialized descriptor"
    data = ast.literal_eval(found.group(1))
    body = "\n".join(f'    "{line}"' for line in textwrap.wrap(base64.b64encode(data).decode(), 100))
    OUT.write_text(f'''"""Triton Inference Server's `model_config.proto` (package `inference`), as the serialized
FileDescriptorProto that tritonclient {version} ships in tritonclient/grpc/model_config_pb2.py.

Kept as the descriptor rather than that generated module: the module checks the protobuf runtime
(it needs protobuf 6.33+) and registers `inference.ModelConfig` in the default pool, while
fxport's base install runs on protobuf 4.25 to 7 and may sit beside tritonclient itself. Loaded
into a pool of its own (fxport/serving/triton.py), it parses a config.pbtxt exactly as Triton's
own message does. Regenerate with scripts/vendor_triton_model_config.py.

Triton's license (BSD-3-Clause), as the wheel carries it:

{license_text}
"""

from __future__ import annotations

import base64

SOURCE = "tritonclient {version}, tritonclient/grpc/model_config_pb2.py"
FILE_DESCRIPTOR = base64.b64decode(
{body}
)
''')
    print(f"wrote {OUT} ({len(data)} descriptor bytes from tritonclient {version})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2.73.0")
