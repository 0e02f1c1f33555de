"""llguidance's verdict on grammars, run as a child process by `isolated.py` (run by path: mlxinfer is not imported).

Reads {"grammars": [text, ...], "limits": {...}} as JSON on stdin and writes one JSON line:
{"verdicts": [[is_error, [message, ...]], ...]}. A grammar that crashes the compiler (a native stack
overflow) or runs away ends this process, not the one that asked.
"""

import json
import sys


def _cap_resources(cpu_s: int, memory_bytes: int) -> None:
    try:
        import resource  # POSIX only
    except ImportError:
        return
    for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_bytes)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # macOS refuses RLIMIT_AS; the parent's deadline still holds
            pass


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    _cap_resources(int(request["cpu_s"]), int(request["memory_bytes"]))
    import llguidance

    limits = llguidance.LLParserLimits(**request["limits"])
    verdicts = [
        list(llguidance.LLMatcher.validate_grammar_with_warnings(text, None, limits=limits))
        for text in request["grammars"]
    ]
    sys.stdout.write(json.dumps({"verdicts": verdicts}) + "\n")


if __name__ == "__main__":
    main()
