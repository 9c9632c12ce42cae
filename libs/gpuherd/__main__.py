from gpuherd.cli import main

main()
