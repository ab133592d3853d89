"""`python -m sglang.launch_server --model-path ...`

The fork server that starts the worker processes is launched first, so its imports run while this process imports
the HTTP stack and resolves the model (srt/managers/worker_processes.py). A worker re-imports this module (as
`__mp_main__`): the server is imported only under the main guard, so workers import what they run and no HTTP
stack."""

import sys

if __name__ == "__main__":
    from sglang.srt.managers.worker_processes import start_fork_server

    start_fork_server()

    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.managers.process_utils import exit_without_teardown
    from sglang.srt.server_args import prepare_server_args

    code: object = 0
    try:
        launch_server(prepare_server_args(sys.argv[1:]))
    except SystemExit as e:
        code = e.code
    exit_without_teardown(code)
