"""torchft's lighthouse, as the `torchft_lighthouse` command of the torchft
wheel runs it and with the same arguments, started without importing the
torchft package: the package imports torch, about 1.8 s a start on a 2-core
machine, and the fault-tolerance tests start a lighthouse per test. The
server is the wheel's own (its `_torchft` extension)."""
import importlib.machinery
import importlib.util
import os
import sys


def main():
    spec = importlib.util.find_spec("torchft")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"torchft is not installed for {sys.executable}: run scripts/setup.sh")
    pkg = list(spec.submodule_search_locations)[0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(pkg, "_torchft" + suffix)
        if os.path.exists(path):
            break
    else:
        sys.exit(f"no _torchft extension in {pkg}: reinstall torchft-nightly (scripts/setup.sh)")
    ext = importlib.util.spec_from_file_location("torchft._torchft", path)
    module = importlib.util.module_from_spec(ext)
    ext.loader.exec_module(module)
    # Like the console script: the server parses the process's own arguments.
    sys.exit(module.lighthouse_main())


if __name__ == "__main__":
    main()
