from kvcdn_core.cli.app import main

main()
