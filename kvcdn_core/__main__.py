from kvcdn_core.cli import main

main()
