set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/speedup_vs_nodes.png'
set title 'Speedup over 1 node(s)'
set xlabel 'nodes'
set ylabel 'speedup'
set grid
set key top left
set xtics 1
plot 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 0 using 1:2 with linespoints lw 2 pt 7 title 'load=1', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 1 using 1:2 with linespoints lw 2 pt 7 title 'load=2', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 2 using 1:2 with linespoints lw 2 pt 7 title 'load=4', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 3 using 1:2 with linespoints lw 2 pt 7 title 'load=8', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 4 using 1:2 with linespoints lw 2 pt 7 title 'load=16', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 5 using 1:2 with linespoints lw 2 pt 7 title 'load=32', 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/by_nodes.dat' index 6 using 1:2 with linespoints lw 2 pt 7 title 'load=64'
