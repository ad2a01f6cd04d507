from gpuq.cli.app import main

main()
