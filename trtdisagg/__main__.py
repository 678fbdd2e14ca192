import sys

from trtdisagg.startup_gc import pause_gc_for_imports

pause_gc_for_imports()  # before torch and the rest are imported: resumed by each entry point

from trtdisagg.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
