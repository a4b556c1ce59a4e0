from mtrain_cli.cli import main

main()
