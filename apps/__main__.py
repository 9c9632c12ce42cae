from apps.cli import main

main()
