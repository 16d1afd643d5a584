set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/compute_comm.png'
set title 'Per-stage time: compute vs communication'
set style data histograms
set style histogram rowstacked
set style fill solid 0.8 border -1
set boxwidth 0.8
set ylabel 'seconds'
set xtics rotate by -45
set key top left
plot 'docs/results/openllama-3b-h200x2-batch-invariant/run-nccl/plots/stage_time.dat' using 3:xtic(2) title 'compute', '' using 4 title 'transfer'
