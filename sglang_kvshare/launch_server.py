"""``python -m sglang_kvshare.launch_server``: an SGLang server with kvshare on.

Accepts every ``sglang.launch_server`` option plus the ``--kvshare-*`` ones
(``--help`` lists them); the launcher itself is ``server/launcher.py``.
"""

from sglang_kvshare.server.launcher import main

if __name__ == "__main__":
    main()
