from prime_core.cli.app import main

main()
