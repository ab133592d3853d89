"""`python -m sglang.launch_server --model-path ...`"""

import sys

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.server_args import prepare_server_args

if __name__ == "__main__":
    launch_server(prepare_server_args(sys.argv[1:]))
