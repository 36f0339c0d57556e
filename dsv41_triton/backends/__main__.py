"""``python -m dsv41_triton.backends``: which attention backends run on this machine's default
device, for which kinds of work, and why not the others."""
from .registry import default_device, format_backend_status


def main() -> None:
    print(f"device: {default_device()}")
    print(format_backend_status())


if __name__ == "__main__":
    main()
